"""Live utilisation: each engine step's achieved bandwidth and FLOP rate against the roofline.

The engine times every step; this module turns the batch the scheduler chose
into the bytes the step had to move and the FLOPs it had to do (the analytic
model of `rooflm.perf.roofline.step_cost`), and divides by the measured time:

    MBU = step bytes / elapsed / peak bandwidth
    MFU = step FLOPs / elapsed / peak FLOP/s of the linear layers' format

A batch is read the way the model runner reads it: a scheduled sequence with
one new token whose K/V is then complete is a decode row (it attends to its
whole context and is sampled); anything else is a prefill chunk, which may
start after a cached prefix (an earlier chunk, or a prefix-cache hit) and is
sampled only when it finishes the prompt (n times for a prompt that forks into
n samples).

It runs every step, so it stays cheap: one pass over the scheduled sequences
with plain attribute reads, and step_cost's totals evaluated from coefficients
fixed at construction (_AffineStepCost) rather than its op list rebuilt; for
256 sequences that is tens of microseconds (tests/perf/test_live.py prints it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from rooflm.config import ModelConfig
from rooflm.perf.gpus import GpuSpec, _match_table_entry
from rooflm.perf.roofline import step_cost

if TYPE_CHECKING:
    from rooflm.engine.scheduler import SchedulerOutput


@dataclass
class StepStats:
    """One step: what it had to move and compute, and how fast that was."""

    elapsed_s: float
    bytes: float  # device-memory bytes the step had to move (step_cost)
    flops: float
    achieved_gbps: float  # bytes / elapsed, in GB/s (1e9)
    achieved_tflops: float  # flops / elapsed, in TFLOP/s (1e12)
    mbu: Optional[float]  # None without a GPU spec
    mfu: Optional[float]
    num_tokens: int = 0  # tokens through the layers (decode rows + prefill tokens)
    num_sampled: int = 0  # rows through the LM head and the sampler


@dataclass
class MeterSummary:
    """The rolling window: sums over its steps, rates over their summed step time.

    Rates are over the time spent inside steps, not wall time: an idle engine
    does not drag MBU down, and the log line says how busy it was instead.
    """

    steps: int
    busy_s: float
    tokens_per_s: float  # all tokens through the layers (prompt + decode)
    sampled_per_s: float  # generated tokens
    achieved_gbps: float
    achieved_tflops: float
    mbu: Optional[float]
    mfu: Optional[float]

    def format(self) -> str:
        """A short fragment for the engine's periodic log line."""
        if self.steps == 0:
            return "no steps"
        text = (f"{self.tokens_per_s:,.0f} tok/s ({self.sampled_per_s:,.0f} generated), "
                f"{self.achieved_gbps:,.1f} GB/s, {self.achieved_tflops:,.2f} TFLOP/s")
        if self.mbu is not None:
            text += f", MBU {self.mbu:.1%}, MFU {self.mfu:.1%}"
        return text


def _compute_dtype_for(weight_dtype_bytes: float) -> str:
    return "fp32" if weight_dtype_bytes >= 4 else "bf16"


_NO_WINDOW = 1 << 62  # a context length no sequence reaches

_SHAPE_KEYS = ("num_decode_seqs", "decode_context_tokens", "prefill_tokens",
               "prefill_attention_pairs", "prefill_context_tokens", "num_sampled_prefills")


class _AffineStepCost:
    """step_cost's bytes and FLOPs for one model and dtypes, without building its op list.

    step_cost adds up products of the batch's six integers with constants of the
    model and the dtypes, except for one step: the LM head's weight is read only
    when some row is sampled. So bytes and FLOPs are base + coef . batch, plus
    the head's read when num_decode_seqs + num_sampled_prefills > 0, and a few
    calls of step_cost at construction fix base, coef and the head's read. The
    meter checks this against step_cost on probe batches and does not use it if
    they disagree (a future non-linear term), calling step_cost every step instead.
    """

    def __init__(self, cost_fn):
        zero = dict.fromkeys(_SHAPE_KEYS, 0)

        def at(**shape):
            cost = cost_fn(**{**zero, **shape})
            return cost.bytes, cost.flops

        self.base = at()
        self.coef = {}
        for key in _SHAPE_KEYS:
            one, two = at(**{key: 1}), at(**{key: 2})
            self.coef[key] = (two[0] - one[0], two[1] - one[1])
        one = at(num_sampled_prefills=1)
        c = self.coef["num_sampled_prefills"]
        self.head = (one[0] - self.base[0] - c[0], one[1] - self.base[1] - c[1])
        self.ok = all(self._matches(cost_fn, probe) for probe in (
            dict(num_decode_seqs=3, decode_context_tokens=1000, prefill_tokens=77,
                 prefill_attention_pairs=5000, prefill_context_tokens=300, num_sampled_prefills=2),
            dict(zero, prefill_tokens=5, prefill_attention_pairs=15, prefill_context_tokens=5),
            dict(zero, num_decode_seqs=256, decode_context_tokens=256 * 4096)))

    def _matches(self, cost_fn, shape: dict) -> bool:
        cost = cost_fn(**shape)
        got = self(shape)
        return all(abs(g - r) <= 1e-9 * max(abs(r), 1.0) for g, r in zip(got, (cost.bytes, cost.flops)))

    def __call__(self, shape: dict) -> tuple[float, float]:
        b, f = self.base
        for key, value in shape.items():
            if value:
                cb, cf = self.coef[key]
                b += cb * value
                f += cf * value
        if shape["num_decode_seqs"] or shape["num_sampled_prefills"]:
            b += self.head[0]
            f += self.head[1]
        return b, f


class StepMeter:
    """Turns (SchedulerOutput, elapsed seconds) into StepStats and keeps a rolling window.

    model_config: the model's shape. weight_dtype_bytes / kv_dtype_bytes: bytes per
    weight parameter and per KV-cache element (4 for fp32, 2 for bf16, ...).
    gpu: the peaks to measure against, or None (CPU): then mbu and mfu are None.
    act_bytes: bytes per activation element (default: 4 with fp32 weights, else 2).
    compute_dtype: tensor-core format of the linear layers (default: fp32 with fp32
    weights, else bf16; pass "fp8" for W8A8). window: steps kept for summary().
    """

    def __init__(self, model_config: ModelConfig, weight_dtype_bytes: float, kv_dtype_bytes: float,
                 gpu: Optional[GpuSpec] = None, *, act_bytes: Optional[float] = None,
                 compute_dtype: Optional[str] = None, window: int = 256):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.model_config = model_config
        self.weight_bytes = float(weight_dtype_bytes)
        self.kv_bytes = float(kv_dtype_bytes)
        self.act_bytes = float(act_bytes if act_bytes is not None
                               else (4.0 if weight_dtype_bytes >= 4 else 2.0))
        self.compute_dtype = compute_dtype or _compute_dtype_for(weight_dtype_bytes)
        self.gpu = gpu
        self._window = window
        self._sliding_window = model_config.sliding_window
        # Peaks resolved once; a GPU lacking the format raises here, not every step.
        self._bw = gpu.mem_bw if gpu is not None else None
        self._peak = gpu.peak_flops(self.compute_dtype) if gpu is not None else None
        self._affine = _AffineStepCost(self._step_cost)
        self._recent: deque[StepStats] = deque(maxlen=window)
        self.total_steps = 0
        self.total_elapsed_s = 0.0
        self.total_tokens = 0
        self.total_sampled = 0

    @classmethod
    def for_engine(cls, engine, gpu: Optional[GpuSpec] = None, **kwargs) -> "StepMeter":
        """A meter for an LLMEngine: its model shape, its runner's dtype, its device's GPU.

        gpu: None looks the device up in the GPU table (default_gpu_for).
        """
        runner = engine.runner
        elem = runner.dtype.itemsize
        kv_elem = getattr(getattr(runner, "kv_cache", None), "dtype", runner.dtype).itemsize
        if gpu is None:
            gpu = default_gpu_for(runner.device)
        return cls(engine.model_config, elem, kv_elem, gpu, **kwargs)

    # ---- one step -------------------------------------------------------------------------

    def batch_shape(self, sched_out: "SchedulerOutput") -> dict[str, int]:
        """The step_cost arguments that describe this batch.

        Contract: call it with the SchedulerOutput that was just executed, *before*
        the engine advances each sequence's num_computed_tokens (the start of each
        scheduled chunk must still be intact), i.e. between runner.execute and
        the output processing.
        """
        # Without a sliding window nothing is clipped: a cap no context reaches.
        cap = self._sliding_window if self._sliding_window is not None else _NO_WINDOW
        num_decode = 0
        decode_ctx = 0
        prefill_tokens = 0
        prefill_pairs = 0
        prefill_ctx = 0
        sampled_prefills = 0
        for sch in sched_out.scheduled:
            seq = sch.seq
            n = sch.num_new_tokens
            end = sch.start + n  # captured at scheduling: valid before and after counters move
            # A decode row: one new token that completes the K/V, past the prompt's first
            # sample (that one may fork into n rows: see below). It attends its whole
            # context, the new token included. The common case, so tested first and cheaply.
            if n == 1 and sch.completes and end != seq.num_prompt_tokens:
                num_decode += 1
                decode_ctx += end if end < cap else cap
                continue
            start = sch.start
            completes = sch.completes
            req = sch.request
            forks = not req.forked and req.params.n > 1
            if n == 1 and completes and not forks:
                num_decode += 1  # the prompt's last token computed on its own: decode-shaped
                decode_ctx += end if end < cap else cap
                continue
            prefill_tokens += n
            prefill_ctx += (start if start < cap else cap) + n
            # causal_pairs(n, start, window), inlined: this loop runs every step.
            k = min(max(cap - start, 0), n)  # new tokens that see fewer than `cap` positions
            prefill_pairs += k * start + k * (k + 1) // 2 + (n - k) * cap
            if completes:
                # A prompt that forks into n samples is sampled n times (the runner's rows).
                sampled_prefills += req.params.n if forks else 1
        return dict(num_decode_seqs=num_decode, decode_context_tokens=decode_ctx,
                    prefill_tokens=prefill_tokens, prefill_attention_pairs=prefill_pairs,
                    prefill_context_tokens=prefill_ctx, num_sampled_prefills=sampled_prefills)

    def _step_cost(self, **shape):
        return step_cost(self.model_config, **shape, weight_bytes=self.weight_bytes,
                         kv_bytes=self.kv_bytes, act_bytes=self.act_bytes,
                         compute_dtype=self.compute_dtype)

    def cost(self, sched_out: "SchedulerOutput"):
        """step_cost of the batch, every op of it (the same contract as batch_shape)."""
        return self._step_cost(**self.batch_shape(sched_out))

    def record(self, sched_out: "SchedulerOutput", elapsed_s: float) -> StepStats:
        """Account one executed step that took `elapsed_s` seconds.

        Contract: `sched_out` is the SchedulerOutput the engine just executed, and
        the engine has NOT yet advanced num_computed_tokens for it (call this after
        runner.execute and before output processing). Called later, every chunk
        would look as if it started at its end and the counts would be wrong.

        `elapsed_s` should include the device's work: on CUDA the runner's
        `.tolist()` of the sampled ids synchronises, so timing runner.execute does.
        A step that samples nothing (only mid-prompt chunks) has no sync; its
        device time then lands in the next step, which evens out over the window.
        """
        shape = self.batch_shape(sched_out)
        if self._affine.ok:
            step_bytes, step_flops = self._affine(shape)
        else:
            cost = self._step_cost(**shape)
            step_bytes, step_flops = cost.bytes, cost.flops
        num_tokens = shape["num_decode_seqs"] + shape["prefill_tokens"]
        num_sampled = shape["num_decode_seqs"] + shape["num_sampled_prefills"]
        elapsed = elapsed_s if elapsed_s > 0 else 1e-12
        bw = step_bytes / elapsed
        rate = step_flops / elapsed
        stats = StepStats(
            elapsed_s=elapsed_s, bytes=step_bytes, flops=step_flops,
            achieved_gbps=bw / 1e9, achieved_tflops=rate / 1e12,
            mbu=bw / self._bw if self._bw else None,
            mfu=rate / self._peak if self._peak else None,
            num_tokens=num_tokens, num_sampled=num_sampled)
        self._recent.append(stats)
        self.total_steps += 1
        self.total_elapsed_s += elapsed_s
        self.total_tokens += num_tokens
        self.total_sampled += num_sampled
        return stats

    # ---- the window ----------------------------------------------------------------------

    def summary(self) -> MeterSummary:
        """Rates over the last `window` steps, for the engine's periodic log line."""
        steps = list(self._recent)
        busy = sum(s.elapsed_s for s in steps)
        if not steps or busy <= 0:
            return MeterSummary(len(steps), busy, 0.0, 0.0, 0.0, 0.0,
                                0.0 if self.gpu else None, 0.0 if self.gpu else None)
        total_bytes = sum(s.bytes for s in steps)
        total_flops = sum(s.flops for s in steps)
        bw = total_bytes / busy
        rate = total_flops / busy
        return MeterSummary(
            steps=len(steps), busy_s=busy,
            tokens_per_s=sum(s.num_tokens for s in steps) / busy,
            sampled_per_s=sum(s.num_sampled for s in steps) / busy,
            achieved_gbps=bw / 1e9, achieved_tflops=rate / 1e12,
            mbu=bw / self._bw if self._bw else None,
            mfu=rate / self._peak if self._peak else None)

    def reset(self) -> None:
        self._recent.clear()


def default_gpu_for(device) -> Optional[GpuSpec]:
    """The GPU table's entry for a CUDA device (H100 -> h100, H200 -> h200, A100 -> a100, ...).

    None for a CPU, or for a CUDA device the table does not know (measure it
    with rooflm.perf.gpus.measure_gpu instead).
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _match_table_entry(torch.cuda.get_device_name(device))
