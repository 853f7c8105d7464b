"""`rooflm bench train`: one shape, one knob at a time, speed and memory of each.

Rows (each a full `rooflm train` run of --max-steps steps in this process):
  fp32          fp32 weights and matmuls, eager, for-each AdamW: the baseline
  bf16          bf16 autocast
  fp16          fp16 autocast with dynamic loss scaling
  fused         bf16 + fused AdamW
  compile       bf16 + fused AdamW + torch.compile per block: the "best" row
  cudnn         best with cuDNN's attention kernel tried first
  selective     best + selective activation checkpointing
  full          best + full activation checkpointing
  fsdp          best + FSDP2 over the processes of this launch (a world of one without torchrun)
"best" includes torch.compile only when the compile row is among --knobs (compiling on a
CPU takes minutes). Under torchrun with several processes the rows that are not fsdp run DDP.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys

# torch is imported inside the functions that train: the CLI builds this parser for every command.
from rooflm.train.config import TrainConfig

BEST = dict(precision="bf16", fused=True, compile=True)
KNOBS = {
    "fp32": dict(precision="fp32"),
    "bf16": dict(precision="bf16"),
    "fp16": dict(precision="fp16"),
    "fused": dict(precision="bf16", fused=True),
    "compile": dict(BEST),
    "cudnn": dict(BEST, sdpa_backend="cudnn"),
    "selective": dict(BEST, activation_checkpointing="selective"),
    "full": dict(BEST, activation_checkpointing="full"),
    "fsdp": dict(BEST, parallel="fsdp"),
}
_OFF = dict(precision="fp32", fused=False, compile=False, activation_checkpointing="none",
            sdpa_backend="auto")


def knob_config(base: TrainConfig, knob: str, compile_best: bool = True) -> TrainConfig:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    changes = dict(_OFF, parallel="ddp" if world > 1 else "none", profile=True, save_dir=None,
                   resume=None, results=None)
    changes.update(KNOBS[knob])
    if knob != "compile" and not compile_best:
        changes["compile"] = False
    return dataclasses.replace(base, **changes)


def _short_verdict(result: dict) -> str:
    causes = result.get("causes_s")
    if not causes:
        return "-"
    return max(causes, key=causes.get)


def run_sweep(base: TrainConfig, knobs: list[str], gpu=None, out=None) -> list[dict]:
    """One training run per knob; with `out`, each run's full results go to out/train_KNOB.json."""
    import torch
    from rooflm.train.trainer import train

    rows = []
    for knob in knobs:
        cfg = knob_config(base, knob, compile_best="compile" in knobs)
        if out:
            cfg = dataclasses.replace(cfg, results=os.path.join(out, f"train_{knob}.json"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            result = train(cfg, gpu)
            rows.append(dict(knob=knob, **{k: result[k] for k in (
                "tokens_per_s", "mfu", "peak_memory_bytes", "predicted_memory_bytes",
                "predicted_memory_recipe_bytes", "step_s",
                "phases_s", "kernels_s", "verdict", "last_loss")}, limit=_short_verdict(result)))
        except (RuntimeError, ValueError) as exc:  # e.g. out of memory: the row says so
            rows.append(dict(knob=knob, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
        finally:
            import torch._dynamo as dynamo

            dynamo.reset()  # a compiled row's graphs must not serve the next row
            gc.collect()
    return rows


def format_table(rows: list[dict]) -> str:
    base = next((r for r in rows if r.get("tokens_per_s")), None)
    lines = ["| knob | tokens/s | vs first | MFU | peak GiB | predicted GiB (memory --train / recipe) | limit |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['knob']} | {r['error']} | | | | | |")
            continue
        speed = r["tokens_per_s"] or 0.0
        ratio = speed / base["tokens_per_s"] if base and speed else 0.0
        lines.append(f"| {r['knob']} | {speed:,.0f} | {ratio:.2f}x | {(r['mfu'] or 0):.1%} | "
                     f"{r['peak_memory_bytes'] / 2**30:.2f} | {r['predicted_memory_bytes'] / 2**30:.2f} / "
                     f"{r['predicted_memory_recipe_bytes'] / 2**30:.2f} | "
                     f"{r['limit']} |")
    return "\n".join(lines)


def cmd_bench_train(args: argparse.Namespace) -> int:
    from rooflm.train.commands import config_from_args, is_rank_zero, run_job

    knobs = [k.strip() for k in args.knobs.split(",") if k.strip()]
    unknown = [k for k in knobs if k not in KNOBS]
    if unknown:
        print(f"error: unknown knob(s) {', '.join(unknown)}; known: {', '.join(KNOBS)}", file=sys.stderr)
        return 2
    rc, base = run_job(lambda: config_from_args(args, progress=False))
    if rc:
        return rc
    rc, rows = run_job(lambda: run_sweep(base, knobs, args.gpu, args.out))
    if rc or not is_rank_zero():
        return rc
    table = format_table(rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_train.json"), "w", encoding="utf-8") as f:
            json.dump({"model": base.model, "seq_len": base.seq_len, "micro_batch": base.micro_batch,
                       "grad_accum": base.grad_accum, "rows": rows}, f, indent=2)
        with open(os.path.join(args.out, "bench_train.md"), "w", encoding="utf-8") as f:
            f.write(table + "\n")
    print(f"model {base.model or 'default'}, seq {base.seq_len} x micro-batch {base.micro_batch} "
          f"x grad-accum {base.grad_accum}, {base.max_steps} steps per knob")
    print(table)
    return 0


def register(bench_subparsers) -> None:
    from rooflm.train.commands import add_train_args

    p = bench_subparsers.add_parser(
        "train", help="training knob sweep: speed and memory of bf16, compile, checkpointing, "
                      "fused AdamW, FSDP on one shape",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(p, skip=("precision", "compile", "activation_checkpointing", "fused", "parallel",
                            "sdpa_backend",
                            "save_dir", "save_every", "resume", "results", "profile", "progress"))
    p.add_argument("--knobs", default=",".join(KNOBS), help=f"rows to run, of {', '.join(KNOBS)}")
    p.add_argument("--out", default=None, help="directory for bench_train.json and bench_train.md")
    p.set_defaults(func=cmd_bench_train, max_steps=8, warmup_measure_steps=3)
