"""rooflm's native block matmuls against torch's int4/int8 kernels, in one process, one model.

    python benchmarks/cpu_block_matmul_ab.py --threads 1 --reps 4

Why one process: on a shared machine two runs minutes apart meet different loads. Here the
default model is loaded once (native kernels, rooflm/quant/native.py) and every quantized
linear also gets torch's kernel module over the same blocks (Int4GroupLinear, Int8BlockLinear
for the tied Q8_0 head); each repetition swaps all of them, generates 32 in / 64 out greedy
(end-to-end tokens/s, wall clock) and then times 20 replays of a captured decode step
(forward + LM head; thread CPU time at 1 thread, which a busy machine inflates less than wall
time, else wall time). Reports medians, the load average, and how many greedy tokens agree.
Writes <out-dir>/cpu_block_matmul_ab-t<threads>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def torch_twin(method):
    """Torch's kernel module over the same blocks as a NativeBlockLinear."""
    from rooflm.quant.gguf_blocks import BlockTensor
    from rooflm.quant.linear_method import Int4GroupLinear, Int8BlockLinear
    scale = method.scale.float().numpy()
    if method.offset is None:
        return Int8BlockLinear(BlockTensor("Q8_0", method.codes.numpy(), scale, np.zeros_like(scale)))
    packed = method.codes.numpy()
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(method.out_features,
                                                                          method.in_features)
    return Int4GroupLinear(BlockTensor("Q4_1", codes, scale, method.offset.float().numpy()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from rooflm import LLM, SamplingParams
    from rooflm.layers.linear import Linear
    from rooflm.quant.linear_method import NativeBlockLinear

    llm = LLM(device="cpu")
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    if not all(isinstance(m.quant, NativeBlockLinear) for m in linears):
        raise SystemExit("the native kernels are not in use here (no compiler, no AVX2, or switched off)")
    variants = {"native": ([m.quant for m in linears], model.tied_head_quant),
                "torch": ([torch_twin(m.quant) for m in linears], torch_twin(model.tied_head_quant))}
    captured = {}

    def capture(module, a, kwargs):
        if a[0].shape[0] == 1:
            captured["args"] = a
    model.register_forward_pre_hook(capture, with_kwargs=True)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    step_ms = {k: [] for k in variants}
    e2e = {k: [] for k in variants}
    tokens, loads = {}, []
    for rep in range(args.reps + 1):  # the first is a warm-up
        for name, (methods, head) in variants.items():
            for m, q in zip(linears, methods):
                m.quant = q
            model.tied_head_quant = head
            ids = [100 + 37 * rep + j for j in range(32)]
            t0 = time.perf_counter()
            out = llm.generate([ids], params)[0].outputs[0].token_ids
            seconds = time.perf_counter() - t0
            a = captured["args"]
            times = []
            with torch.inference_mode():
                for _ in range(20):
                    t = clock()
                    a[3].plan = None
                    model.compute_logits(model(*a))
                    times.append(clock() - t)
            if rep:
                e2e[name].append(64 / seconds)
                step_ms[name].append(statistics.median(times) * 1000)
                tokens.setdefault(name, list(out))
        loads.append(os.getloadavg()[0])
    agree = next((i for i, (x, y) in enumerate(zip(tokens["native"], tokens["torch"])) if x != y), 64)
    result = {"threads": args.threads, "reps": args.reps, "clock": clock.__name__,
              "decode_step_ms": step_ms, "e2e_tokens_per_s": e2e,
              "median_decode_step_ms": {k: statistics.median(v) for k, v in step_ms.items()},
              "median_e2e_tokens_per_s": {k: statistics.median(v) for k, v in e2e.items()},
              "leading_greedy_tokens_equal": agree, "load_average_1min": loads}
    out_dir = Path(args.out_dir or ROOT / "benchmarks" / "results" / time.strftime("cpu-%Y%m%d"))
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"cpu_block_matmul_ab-t{args.threads}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Native block matmuls vs torch's kernels, one process ({args.threads} threads)", "",
             f"Decode step = forward + LM head of a captured one-token step ({clock.__name__}); "
             f"1-minute load {min(loads):.1f}-{max(loads):.1f}.", "",
             "| kernels | decode step ms (median) | per rep | e2e tok/s (median) | per rep |",
             "| --- | --- | --- | --- | --- |"]
    for k in variants:
        lines.append(f"| {k} | {statistics.median(step_ms[k]):.1f} | {', '.join(f'{x:.1f}' for x in step_ms[k])} "
                     f"| {statistics.median(e2e[k]):.1f} | {', '.join(f'{x:.1f}' for x in e2e[k])} |")
    lines += ["", f"Greedy tokens equal for the first {agree} of 64."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
