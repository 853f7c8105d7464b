"""The training loop: build, wrap, step, measure, save.

One optimizer step is grad_accum micro-steps of (data, forward, backward) and then the
optimizer (unscale, clip, step, LR schedule, zero grads). Timers mark each phase (CUDA
events on a GPU, so the loop does not synchronise inside the step); the loss is read
once per step, which is also where the step's timers are resolved.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F

from rooflm.layers.kernels import TORCH_KERNELS
from rooflm.model.loader import iter_weights, load_model_config, resolve_model
from rooflm.model.registry import get_model_class, model_spec
from rooflm.train import checkpoint, measure, parallel
from rooflm.train.causal import CausalLM, next_token_loss
from rooflm.train.config import TrainConfig
from rooflm.train.data import SYNTHETIC, TokenWindows, read_token_ids
from rooflm.train.qat import apply_qat
from rooflm.train.precision import Precision, convert_to_fp8, get_precision, sdpa_priority


# ---- building ----------------------------------------------------------------------------

def build_model(model: Optional[str], load_format: str, device: torch.device, seq_len: int,
                seed: int, weights_from: Optional[str] = None):
    """(ModelConfig, LlamaForCausalLM in fp32 on device, path, format). Weights come from the
    model's own files, random for dummy, or from a checkpoint directory (resume)."""
    path, fmt = resolve_model(model, load_format)
    cfg = load_model_config(path, fmt)
    if not model_spec(cfg).llama_layers:
        # train/causal.py's CausalBlock runs the Llama layer: another family's parts (post-norms,
        # soft-caps, (1 + w) norms) would train a different model without saying so.
        raise ValueError(f"rooflm train runs Llama-layer families only (Llama, Mistral, Qwen2/3); "
                         f"{cfg.architecture} uses parts the training view does not have yet")
    cls = get_model_class(cfg.architecture)
    with torch.device(device):
        # Torch kernels only: the Triton inference kernels have no backward.
        lm = cls(cfg, max_positions=max(seq_len, 1), backend=None, kernels=TORCH_KERNELS)
    if weights_from is not None:
        lm.load_weights(iter_weights(weights_from, "safetensors"))
    elif fmt == "dummy":
        lm.init_dummy_weights(seed)
    else:
        lm.load_weights(iter_weights(path, fmt, keep_quantized=False))  # GGUF: dequantized to fp32
    return cfg, lm, path, fmt


def load_tokens(cfg: TrainConfig, model_cfg, path: str, fmt: str) -> TokenWindows:
    if cfg.data is None:
        return TokenWindows(None, cfg.seq_len, model_cfg.vocab_size, cfg.seed, SYNTHETIC)
    tokenizer = None
    if not cfg.data.endswith((".npy", ".ids")):
        from rooflm.tokenizer.tokenizer import load_model_tokenizer

        tokenizer = load_model_tokenizer(None, path, fmt)
    ids = read_token_ids(cfg.data, model_cfg.vocab_size, tokenizer)
    return TokenWindows(ids, cfg.seq_len, model_cfg.vocab_size, cfg.seed, cfg.data)


def lr_lambda(cfg: TrainConfig):
    """Multiplier of the base LR at a step: linear warm-up, then cosine / linear decay to
    min_lr_ratio at max_steps (or constant)."""
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(cfg.max_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        if cfg.lr_schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay
    return factor


# ---- timing ------------------------------------------------------------------------------

class StepTimer:
    """Marks phase boundaries; resolves them into seconds per phase after the step's sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, phase_ending: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase_ending, event))
        else:
            self.marks.append((phase_ending, time.perf_counter()))

    def resolve(self) -> measure.PhaseTimes:
        times = measure.PhaseTimes()
        for (_, start), (phase, end) in zip(self.marks, self.marks[1:]):
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            setattr(times, phase, getattr(times, phase) + seconds)
        self.marks = []
        return times


# ---- the run -----------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg: TrainConfig, gpu: Optional[str] = None):
        self.cfg = cfg
        self.gpu = gpu
        self.info = parallel.init(cfg.parallel, cfg.device)
        self.device = self.info.device
        self.precision: Precision = get_precision(cfg.precision, self.device.type)
        torch.manual_seed(cfg.seed)
        self.resume_state = checkpoint.read_state(cfg.resume) if cfg.resume else None

        self.model_cfg, lm, path, fmt = build_model(cfg.model, cfg.load_format, self.device, cfg.seq_len,
                                                    cfg.seed, weights_from=cfg.resume)
        self.data = load_tokens(cfg, self.model_cfg, path, fmt)
        self.model = CausalLM(lm, cfg.activation_checkpointing)
        if cfg.precision == "fp8":
            convert_to_fp8(self.model)
        if cfg.qat:
            apply_qat(self.model, cfg.qat)
        self.teacher = self._build_teacher() if cfg.teacher else None
        if cfg.compile:
            for block in self.model.blocks:
                block.compile()
            self.model.loss_fn = torch.compile(next_token_loss)
        sixteen_bit = self.precision.autocast_dtype if cfg.precision in ("bf16", "fp16") else None
        self.wrapped = parallel.wrap(self.model, cfg.parallel, self.info, sixteen_bit)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay, fused=cfg.fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.scaler = self.precision.grad_scaler(self.device.type)
        self.start_step = 0
        self.losses: list[float] = []
        if self.resume_state is not None:
            self.start_step = checkpoint.restore(self.resume_state, self.model, self.optimizer,
                                                 self.scheduler, self.scaler, cfg.parallel == "fsdp")
            self.losses = list(self.resume_state["losses"])
        self.step_times: list[float] = []
        self.phases: list[measure.PhaseTimes] = []
        self.kernels: Optional[dict[str, float]] = None
        self.profiled_step_s: Optional[float] = None

    def _build_teacher(self) -> CausalLM:
        cfg = self.cfg
        tcfg, teacher, _, _ = build_model(cfg.teacher, cfg.teacher_load_format, self.device, cfg.seq_len,
                                          cfg.seed)
        if tcfg.vocab_size != self.model_cfg.vocab_size:
            raise ValueError(f"distillation needs one vocabulary: the teacher has {tcfg.vocab_size} "
                             f"tokens, the student {self.model_cfg.vocab_size}")
        teacher.requires_grad_(False)
        return CausalLM(teacher).eval()

    # ---- one step ----

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The attention kernel is chosen in the forward; its backward follows it.
        with self.precision.autocast(self.device.type), sdpa_priority(self.cfg.sdpa_backend):
            if self.teacher is None:
                return self.wrapped(inputs, targets)
            loss, logits = self.wrapped(inputs, targets, return_logits=True)
            with torch.no_grad():
                teacher_logits = self.teacher(inputs)
        # Hinton's distillation: KL(teacher || student) at temperature T, scaled by T^2 so its
        # gradients keep their size as T changes; alpha mixes it with the next-token loss.
        t = self.cfg.distill_temperature
        kl = F.kl_div(F.log_softmax(logits.float() / t, dim=-1).flatten(0, 1),
                      F.log_softmax(teacher_logits.float() / t, dim=-1).flatten(0, 1),
                      log_target=True, reduction="batchmean") * t * t
        alpha = self.cfg.distill_alpha
        return alpha * kl + (1.0 - alpha) * loss

    def train_step(self, step: int, timer: StepTimer) -> torch.Tensor:
        cfg, info = self.cfg, self.info
        total = torch.zeros((), device=self.device)
        timer.mark("data")  # the step's start
        for micro in range(cfg.grad_accum):
            inputs, targets = self.data.batch(step, micro, cfg.grad_accum, info.rank, info.world_size,
                                              cfg.micro_batch)
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            timer.mark("data")
            last = micro == cfg.grad_accum - 1
            with parallel.grad_sync(self.wrapped, cfg.parallel, last):
                loss = self._loss(inputs, targets)
                timer.mark("forward")
                scaled = loss / cfg.grad_accum
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                timer.mark("backward")
            total += loss.detach()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        return parallel.mean_over_ranks(total / cfg.grad_accum, info)

    def _profile_step(self, step: int, timer: StepTimer) -> float:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            loss = self.train_step(step, timer).item()
            self._sync()
            self.profiled_step_s = time.perf_counter() - t0
        timer.resolve()
        self.kernels = measure.kernel_breakdown(prof, self.device.type == "cuda")
        return loss

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self) -> dict:
        cfg, info = self.cfg, self.info
        timer = StepTimer(self.device)
        # The roof first: measuring it allocates buffers that are no part of training's peak.
        roof = measure.device_roof(self.device, self.precision.peak_format, self.gpu)
        measure.reset_peak_memory(self.device)
        first_measured = self.start_step + cfg.warmup_measure_steps
        # Profile the last step, once the warm-up is over and a timed step came before it.
        profile_at = cfg.max_steps - 1 if cfg.profile and cfg.max_steps - 1 > first_measured else None
        bar = self._progress_bar()
        tokens_per_step = cfg.tokens_per_step * info.world_size
        flops_per_rank_step = (measure.train_flops_per_sequence(self.model_cfg, cfg.seq_len)
                               * cfg.micro_batch * cfg.grad_accum)
        self.steps_done = self.start_step
        try:
            self._loop(timer, roof, first_measured, profile_at, bar, tokens_per_step, flops_per_rank_step)
        except KeyboardInterrupt:
            if bar is not None:
                bar.close()
            if info.is_main:  # the partial result: how far it got
                last = f", last loss {self.losses[-1]:.4f}" if self.losses else ""
                print(f"train: stopped after {self.steps_done} of {cfg.max_steps} "
                      f"steps{last}", file=sys.stderr)
            raise
        if bar is not None:
            bar.close()
        if cfg.save_dir:
            self.save(cfg.save_dir, cfg.max_steps)
        return self.results(tokens_per_step, flops_per_rank_step, roof)

    def _loop(self, timer, roof, first_measured, profile_at, bar, tokens_per_step, flops_per_rank_step) -> None:
        cfg = self.cfg
        for step in range(self.start_step, cfg.max_steps):
            if step == profile_at:
                loss = self._profile_step(step, timer)
            else:
                t0 = time.perf_counter()
                loss = self.train_step(step, timer).item()  # the step's one sync
                elapsed = time.perf_counter() - t0
                phases = timer.resolve()
                if step >= first_measured:
                    self.step_times.append(elapsed)
                    self.phases.append(phases)
            if not math.isfinite(loss) and self.scaler is None:
                raise FloatingPointError(f"loss is {loss} at step {step + 1}: training diverged")
            self.losses.append(loss)
            self.steps_done = step + 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(self._postfix(loss, tokens_per_step, flops_per_rank_step, roof))
            if cfg.save_dir and cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.max_steps:
                self.save(os.path.join(cfg.save_dir, f"step-{step + 1}"), step + 1)

    def _progress_bar(self):
        if not (self.cfg.progress and self.info.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.max_steps, initial=self.start_step, desc="train", unit="step",
                    dynamic_ncols=True)

    def _postfix(self, loss, tokens_per_step, flops, roof) -> str:
        if not self.step_times:
            return f"loss {loss:.4f}"
        step_s = self.step_times[-1]
        mem, _ = measure.peak_memory(self.device)
        return (f"loss {loss:.4f} | {tokens_per_step / step_s:,.0f} tok/s | "
                f"MFU {flops / step_s / roof.flops:.1%} | peak {mem / 2**30:.2f} GiB")

    def save(self, directory: str, step: int) -> None:
        checkpoint.save(directory, self.model, self.optimizer, self.scheduler, self.scaler, step,
                        self.losses, _config_dict(self.cfg), self.cfg.parallel == "fsdp", self.info.is_main)

    # ---- results ----

    def results(self, tokens_per_step: int, flops_per_rank_step: float, roof: measure.Roof) -> dict:
        cfg, info = self.cfg, self.info
        step_s = statistics.median(self.step_times) if self.step_times else None
        step_s = parallel.max_over_ranks(step_s, info) if step_s is not None else None
        peak, peak_what = measure.peak_memory(self.device)
        peak = parallel.max_over_ranks(peak, info)
        predicted = measure.predicted_memory(self.model_cfg, cfg.seq_len, cfg.micro_batch,
                                             self.precision.memory_dtype, cfg.parallel, info.world_size,
                                             cfg.activation_checkpointing)
        phases = None
        if self.phases:
            phases = {k: statistics.median(getattr(p, k) for p in self.phases)
                      for k in ("data", "forward", "backward", "optimizer")}
        mfu = flops_per_rank_step / step_s / roof.flops if step_s else None
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "world_size": info.world_size,
            "model": cfg.model or "default (SmolLM2-135M)",
            "architecture": self.model_cfg.architecture,
            "num_params": self.model_cfg.num_params(),
            "config": _config_dict(cfg),
            "data": self.data.source,
            "losses": self.losses,
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "step_s": step_s,
            "tokens_per_s": tokens_per_step / step_s if step_s else None,
            "train_flops_per_step_per_rank": flops_per_rank_step,
            "roof_flops": roof.flops,
            "roof": roof.source,
            "mfu": mfu,
            "peak_memory_bytes": peak,
            "peak_memory_measured_as": peak_what,
            "predicted_memory_bytes": predicted,
            "predicted_memory_recipe_bytes": predicted + measure.recipe_extra_bytes(
                self.model_cfg, cfg.precision, cfg.parallel),
            "phases_s": phases,
            "kernels_s": self.kernels,
            "profiled_step_s": self.profiled_step_s,
        }
        if self.kernels is not None and step_s:
            data_s = phases["data"] if phases else 0.0
            # The profiled step's kernels, scaled to an unprofiled step's length.
            result["verdict"], result["causes_s"] = measure.verdict(
                self.profiled_step_s or step_s, self.kernels, data_s, mfu or 0.0)
        else:
            result["verdict"] = None
        return result


def _config_dict(cfg: TrainConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


def format_summary(r: dict) -> str:
    gib = 2**30
    lines = [f"model {r['model']} ({r['num_params'] / 1e6:.1f}M params) on {r['device']} x{r['world_size']}, "
             f"{r['config']['precision']}, seq {r['config']['seq_len']} x micro-batch "
             f"{r['config']['micro_batch']} x grad-accum {r['config']['grad_accum']}"]
    if r["first_loss"] is not None:
        lines.append(f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} over {len(r['losses'])} steps")
    if r["step_s"]:
        lines.append(f"step {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} tokens/s | "
                     f"MFU {r['mfu']:.1%} of {r['roof_flops'] / 1e12:.2f} TFLOP/s ({r['roof']})")
    else:
        lines.append("too few steps after the warm-up to time (raise --max-steps)")
    lines.append(f"peak memory {r['peak_memory_bytes'] / gib:.2f} GiB ({r['peak_memory_measured_as']}) | "
                 f"rooflm memory --train predicts {r['predicted_memory_bytes'] / gib:.2f} GiB "
                 f"({r['predicted_memory_recipe_bytes'] / gib:.2f} GiB with this recipe's fp32 gradients)")
    if r["phases_s"]:
        p = r["phases_s"]
        lines.append("phases per step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p.items()))
    if r["kernels_s"]:
        k = r["kernels_s"]
        lines.append("profiled step, kernel time: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in k.items())
                     + f" (step {r['profiled_step_s'] * 1e3:.1f} ms)")
    if r["verdict"]:
        lines.append("verdict: " + r["verdict"])
    return "\n".join(lines)


def train(cfg: TrainConfig, gpu: Optional[str] = None) -> dict:
    """Run one training job; rank 0 writes cfg.results (JSON). The process group, if any, stays
    up (a bench sweep runs several jobs in it): the caller ends it with parallel.shutdown."""
    trainer = Trainer(cfg, gpu)
    result = trainer.run()
    if cfg.results and trainer.info.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.results)), exist_ok=True)
        with open(cfg.results, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result
