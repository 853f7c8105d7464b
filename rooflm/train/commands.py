"""`rooflm train` (and, through rooflm.bench.commands, `rooflm bench train`).

The flags are generated from TrainConfig's fields, so a new knob is a new flag.
Launch over several processes with torchrun:
    torchrun --nproc-per-node 2 -m rooflm train --parallel fsdp ...
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from rooflm.train.config import CHECKPOINTING, LR_SCHEDULES, PARALLEL, PRECISIONS, SDPA_BACKENDS, TrainConfig

HELP = {
    "model": "HF directory (safetensors), .gguf file (dequantized to fp32), or a preset with "
             "--load-format dummy; default: the embedded SmolLM2-135M",
    "data": "text file (tokenized with the model's tokenizer), or token ids (.npy, or .ids: "
            "whitespace-separated integers); default: synthetic random ids",
    "precision": "fp32, bf16 (autocast), fp16 (autocast + dynamic loss scaling), fp8 (torchao)",
    "compile": "torch.compile each decoder block",
    "activation_checkpointing": "none, full (recompute each block), selective (keep matmul and "
                                "attention outputs, recompute the rest)",
    "fused": "fused AdamW kernel (one launch for all parameters)",
    "parallel": "none, or under torchrun: ddp or fsdp (FSDP2 fully_shard per decoder block)",
    "lr_schedule": "cosine, linear or constant after --warmup-steps of linear warm-up",
    "sdpa_backend": "the attention kernel tried first (auto: torch's order; cudnn is fastest on H100)",
    "save_dir": "write a checkpoint here (HF safetensors + optimizer/scheduler/RNG state)",
    "save_every": "also checkpoint every N steps, into SAVE_DIR/step-N",
    "resume": "continue from a checkpoint directory (the same --model and --data)",
    "results": "JSON results file",
    "qat": "quantization-aware training: fake-quantize the block weights to int8 or int4 "
           "(per output channel, straight-through gradient)",
    "teacher": "distil from this teacher model (same vocabulary): KL on the logits",
    "warmup_measure_steps": "steps left out of the timing (compile, allocator warm-up)",
    "profile": "profile the last step for the kernel-time breakdown and the verdict",
}
CHOICES = {"precision": PRECISIONS, "activation_checkpointing": CHECKPOINTING,
           "lr_schedule": LR_SCHEDULES, "parallel": PARALLEL, "optimizer": ("adamw",),
           "device": ("auto", "cpu", "cuda"), "sdpa_backend": SDPA_BACKENDS}


def add_train_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for field in dataclasses.fields(TrainConfig):
        if field.name in skip or field.name == "betas":
            continue
        flag = "--" + field.name.replace("_", "-")
        hint = str(field.type)
        kwargs = {"dest": field.name, "default": field.default, "help": HELP.get(field.name, "")}
        if "bool" in hint:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        kwargs["type"] = int if "int" in hint else float if "float" in hint else str
        if field.name in CHOICES:
            kwargs["choices"] = CHOICES[field.name]
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--beta2", type=float, default=TrainConfig.betas[1], help="AdamW beta2")
    parser.add_argument("--gpu", default=None,
                        help="MFU against this GPU of rooflm.perf.gpus's table instead of the "
                             "measured matmul rate (e.g. h100)")


def config_from_args(args: argparse.Namespace, **overrides) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["betas"] = (TrainConfig.betas[0], args.beta2)
    values.update(overrides)
    return TrainConfig(**values)


def run_job(job):
    """job() under the CLI's rules: a ValueError is the user's input, printed as an error (exit 2);
    the process group, if the job made one, ends with it. Returns (exit code, job's result)."""
    from rooflm.train.parallel import shutdown

    try:
        result = job()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        shutdown(clean=False)
        return 2, None
    shutdown()
    return 0, result


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def cmd_train(args: argparse.Namespace) -> int:
    from rooflm.train.trainer import format_summary, train

    rc, cfg = run_job(lambda: config_from_args(args))
    if rc:
        return rc
    rc, result = run_job(lambda: train(cfg, args.gpu))
    if rc == 0 and is_rank_zero():
        print(format_summary(result))
        if cfg.results:
            print(f"results: {cfg.results}")
    return leave(rc)


def leave(rc: int) -> int:
    """A rank of several exits here, past the interpreter's teardown: with the group destroyed,
    gloo's threads could still abort a rank at exit ("terminate called without an active
    exception", SIGABRT after a finished run: CI, 2026-11-26, even after shutdown's barrier),
    failing a run whose results are already written. One process returns normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return rc
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model (causal LM) and measure the step against the hardware",
        description="Causal-LM training on rooflm's own model code: every knob a flag, tokens/s, "
                    "MFU, peak memory against `rooflm memory --train`, a step-time breakdown and "
                    "a verdict. Several processes: torchrun --nproc-per-node N -m rooflm train "
                    "--parallel ddp|fsdp ...")
    add_train_args(p)
    p.set_defaults(func=cmd_train)
