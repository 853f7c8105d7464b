"""Where CUDA graphs and eager steps part: the same prompts greedy through eager, full decode graphs
(piecewise off) and piecewise graphs, printing each run's first tokens and the largest gap between
the eager run's top logprobs and the other run's at the first position where tokens differ.
A near-tie in a random-weight model flips with any rounding change; a bug shows as large gaps.

Usage (GPU): PYTHONPATH=$PWD python benchmarks/graphs_vs_eager.py --model gemma-3-1b [--tokens 8]
    [--variants eager-alone graphs piecewise piecewise-onepool eager-onepool]
eager-alone runs each prompt by itself (the noise of other GEMM shapes); the -onepool variants
turn the KV cache groups off (--disable-hybrid-kv-cache-manager).
"""

import argparse

from rooflm import LLM, SamplingParams


def run(model: str, prompts, tokens: int, dtype: str = "bfloat16", **kw):
    llm = LLM(model=model, load_format="dummy", device="cuda", dtype=dtype, max_model_len=2048,
              max_num_seqs=8, gpu_memory_utilization=0.8, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5))
    del llm
    return outs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=["graphs", "piecewise"],
                   help="compared with eager: eager-alone graphs piecewise piecewise-alone piecewise-onepool eager-onepool")
    p.add_argument("--dtype", default="bfloat16", help="float32: rounding noise ~1e-6, so a gap that stays is a bug")
    args = p.parse_args()
    run_as = lambda prompts, tokens, **kw: run(args.model, prompts, tokens, args.dtype, **kw)  # noqa: E731
    prompts = [list(range(100, 228)), list(range(500, 517))]
    variants = {
        "eager": lambda: run_as(prompts, args.tokens, enforce_eager=True),
        # each prompt in its own run: the rounding noise of other GEMM shapes, with no graph at all
        "eager-alone": lambda: [run_as([p], args.tokens, enforce_eager=True)[0] for p in prompts],
        "graphs": lambda: run_as(prompts, args.tokens, piecewise_cuda_graphs=False),
        # each prompt alone through the piecewise graphs: a 128-token prompt fills its bucket, no padding
        "piecewise-alone": lambda: [run_as([p], args.tokens)[0] for p in prompts],
        "piecewise": lambda: run_as(prompts, args.tokens),
        "piecewise-onepool": lambda: run_as(prompts, args.tokens, disable_hybrid_kv_cache_manager=True),
        "eager-onepool": lambda: run_as(prompts, args.tokens, enforce_eager=True,
                                     disable_hybrid_kv_cache_manager=True),
    }
    runs = {name: variants[name]() for name in ["eager"] + [v for v in args.variants if v != "eager"]}
    base = runs["eager"]
    for name, outs in runs.items():
        for i, (a, b) in enumerate(zip(base, outs)):
            ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
            first = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
            gap = ""
            if first is not None:
                la, lb = a.outputs[0].logprobs[first], b.outputs[0].logprobs[first]
                shared = set(la) & set(lb)
                gap = max((abs(la[t].logprob - lb[t].logprob) for t in shared), default=float("nan"))
                gap = f" first diff at {first}, top-5 shared {len(shared)}, max logprob gap {gap:.4f}"
            # up to the first difference: how far the two runs' log-probabilities already are apart
            upto = len(ta) if first is None else first + 1
            drift = max((abs(la[t].logprob - lb[t].logprob) for la, lb in
                         zip(a.outputs[0].logprobs[:upto], b.outputs[0].logprobs[:upto]) for t in set(la) & set(lb)),
                        default=0.0)
            print(f"{args.model} {name:9s} prompt {i}: {tb[:6]}{gap} (max gap so far {drift:.2e})")


if __name__ == "__main__":
    main()
