"""Where a long prompt's prefill time goes, by kernel class, under torch.profiler.

One engine (the defaults: on an H100 with flash-attn-4, FA4 prefill at block 128), batch 1, a prompt
of --input-len random tokens and one output token (so the measured time is the prefill's), run once
to compile and warm, then once under the profiler. Prints device time by kernel class (the classes
of `rooflm profile`) beside each class's FLOPs and rate, and the wall time of the profiled request.
Usage (GPU machine): python benchmarks/prefill_profile.py --input-len 16000 [--out DIR] [engine flags]
"""

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rooflm import LLM, SamplingParams  # noqa: E402
from rooflm.perf.profile import classify_kernel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input-len", type=int, default=16000)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--prefill-attention", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(model=args.model, load_format="dummy", max_model_len=args.max_model_len,
              prefill_attention=args.prefill_attention, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def prompt():
        return torch.randint(10, 30000, (args.input_len,), generator=gen).tolist()
    for _ in range(2):  # compile, warm
        llm.generate([prompt()], params, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt()], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt()], params, use_tqdm=False)
        torch.cuda.synchronize()
    by_class = collections.defaultdict(float)
    by_kernel = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            by_class[classify_kernel(ev.name)] += us / 1e3
            by_kernel[ev.name[:90]] += us / 1e3
    cfg = llm.engine.model_config
    s = args.input_len
    # Matmul FLOPs: 2 x tokens x non-embedding weights (the LM head on the last token only);
    # attention: 4 D H S^2 / 2 a layer (causal).
    head_dim = cfg.head_dim
    kv = cfg.num_key_value_heads * head_dim
    per_layer = cfg.hidden_size * (cfg.hidden_size + 2 * kv) + cfg.hidden_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    flops = {"GEMM": 2 * s * per_layer * cfg.num_hidden_layers,
             "attention": 2 * head_dim * cfg.num_attention_heads * s * s * cfg.num_hidden_layers}
    total = sum(by_class.values())
    print(f"{args.model}, prompt {s}, prefill {llm.engine.runner.backend.prefill_fa4 and 'fa4' or 'triton'}, "
          f"block {llm.engine.config.cache.block_size}, budget {llm.engine.config.scheduler.max_num_batched_tokens}")
    print(f"request wall time (TTFT + 1 token): {wall_ms:.1f} ms; device time under the profiler: {total:.1f} ms")
    rows = []
    for cls, ms in sorted(by_class.items(), key=lambda kv: -kv[1]):
        rate = flops.get(cls, 0) / ms / 1e9 if ms else 0
        rows.append({"class": cls, "ms": ms, "TFLOPs": rate})
        print(f"  {cls:18s} {ms:8.1f} ms  {100 * ms / total:5.1f}%" + (f"  {rate:6.0f} TFLOP/s" if rate else ""))
    print("top kernels:")
    for name, ms in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {ms:8.1f} ms  {name}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"prefill-profile-{s}.json"), "w") as f:
            json.dump({"wall_ms": wall_ms, "device_ms": total, "classes": rows,
                       "kernels": sorted(by_kernel.items(), key=lambda kv: -kv[1])[:40]}, f, indent=1)


if __name__ == "__main__":
    main()
