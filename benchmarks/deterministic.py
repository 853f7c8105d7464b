"""Are a request's greedy tokens and logprobs independent of how the engine runs it?

48 requests (200-900 prompt tokens, 50-300 new tokens, greedy, random token ids) on a dummy
model, first as one batch (max_num_seqs 64), then under each variant below; for every variant,
how many of the 48 outputs are identical to the batch run (tokens, and tokens + logprobs bit for
bit), and where the first differing token sits. Run once with the defaults and once with
--deterministic. Writes one JSON per mode under --out and prints a table.

    python benchmarks/deterministic.py --model llama-3-8b --out $OUT [--modes default,deterministic]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import time

import torch

from rooflm import LLM, SamplingParams

# name -> engine options over the batch run's. Each is something that must not change a token.
VARIANTS = {
    "alone (max_num_seqs 1)": dict(max_num_seqs=1),
    # No growth reservation at admission: the pool fills and running requests are preempted. Blocks of
    # 16 (the batch run has the CUDA default, 64): also checks that the block size changes no sum.
    "preempt, recompute (small KV pool)": dict(num_blocks=400, block_size=16, preemption_mode="recompute",
                                               reserve_new_tokens=False),
    "preempt, swap (small KV pool)": dict(num_blocks=400, block_size=16, preemption_mode="swap", swap_space_gb=8.0,
                                            reserve_new_tokens=False),
    "eager (no CUDA graphs)": dict(enforce_eager=True),
    "chunk 256, no prefix cache": dict(max_num_batched_tokens=256, enable_prefix_caching=False),
    "async scheduling off": dict(async_scheduling=False),
}
# Left out of the 8B run to keep benchmarks/deterministic.sh within one device call; the GPU tests
# (tests/models/test_gpu_deterministic.py) cover it on the small shape.
SKIPPED_BY_DEFAULT = ("async scheduling off",)
# The measurements of the default mode: the first three comparisons above plus eager.
DEFAULT_MODE_VARIANTS = ("alone (max_num_seqs 1)", "preempt, recompute (small KV pool)", "eager (no CUDA graphs)")


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(1, vocab) for _ in range(rng.randint(200, 900))])
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(50, 300), ignore_eos=True,
                                     logprobs=1))
    return prompts, params


def run(model: str, prompts, params, **options):
    """(outputs as [(token ids, [logprob of each sampled token])], seconds, preemptions)."""
    llm = LLM(model=model, load_format="dummy", max_model_len=2048, **options)
    before = llm.engine.snapshot().num_preemptions
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    preemptions = llm.engine.snapshot().num_preemptions - before
    result = [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
              for o in outs]
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, elapsed, preemptions


def compare(base, other) -> dict:
    same_tokens = sum(a[0] == b[0] for a, b in zip(base, other))
    same_all = sum(a == b for a, b in zip(base, other))
    first = [next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), None) for a, b in zip(base, other)]
    diverged = sorted(i for i in first if i is not None)
    return {"identical_tokens": same_tokens, "identical_tokens_and_logprobs": same_all, "requests": len(base),
            "first_difference_at": [diverged[0], diverged[-1]] if diverged else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--modes", default="default,deterministic")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=None, help="semicolon-separated subset of the variants (default all)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from rooflm.model.presets import get_preset
    prompts, params = workload(args.num_requests, get_preset(args.model).vocab_size)
    chosen = args.variants.split(";") if args.variants else [n for n in VARIANTS if n not in SKIPPED_BY_DEFAULT]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for mode in args.modes.split(","):
        det = mode == "deterministic"
        common = dict(deterministic=det, max_num_seqs=64, device=args.device)
        base, base_s, _ = run(args.model, prompts, params, **common)
        record = {"mode": mode, "model": args.model, "git_commit": commit,
                  "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "batch_run_s": round(base_s, 2), "variants": {}}
        names = [n for n in (VARIANTS if det else DEFAULT_MODE_VARIANTS) if n in chosen]
        for name in names:
            other, seconds, preemptions = run(args.model, prompts, params, **{**common, **VARIANTS[name]})
            cmp = compare(base, other)
            cmp.update(seconds=round(seconds, 2), preemptions=preemptions)
            record["variants"][name] = cmp
            rows.append((mode, name, cmp))
            print(f"{mode:13s} {name:36s} identical {cmp['identical_tokens']:2d}/{cmp['requests']} tokens, "
                  f"{cmp['identical_tokens_and_logprobs']:2d}/{cmp['requests']} with logprobs; "
                  f"first difference {cmp['first_difference_at']}; {preemptions} preemptions; {seconds:.1f} s",
                  flush=True)
        with open(os.path.join(args.out, f"compare-{mode}.json"), "w") as f:
            json.dump(record, f, indent=1)
    print("\nmode          comparison (vs one batch of 48)      tokens  +logprobs  first diff")
    for mode, name, cmp in rows:
        print(f"{mode:13s} {name:36s} {cmp['identical_tokens']:2d}/{cmp['requests']}   "
              f"{cmp['identical_tokens_and_logprobs']:2d}/{cmp['requests']}      {cmp['first_difference_at']}")


if __name__ == "__main__":
    main()
