"""Host profile of speculative steps on the GPU: cProfile of the engine loop (which Python
functions the host spends a verify step in) and the torch profiler's CPU/CUDA op table, with
the replay proposer at 0% corruption (every step verifies k drafts).

    python benchmarks/spec_step_profile.py --batch 16 --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rooflm import LLM, SamplingParams  # noqa: E402
from rooflm.spec.replay import ReplayProposer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/spec-profile")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    llm = LLM(model=args.model, load_format="dummy", max_model_len=512, max_num_seqs=args.batch,
              cuda_graph_max_batch=args.batch, speculative_method="ngram", num_speculative_tokens=args.k,
              speculative_policy="budget")  # every step verifies: the profile is of verify steps
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, params)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
    llm.engine.spec.set_proposer(ReplayProposer(truth, 0.0, vocab))
    llm.generate(prompts, params)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        llm.generate(prompts, params)
    text.write(tp.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    text.write(tp.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    with open(os.path.join(args.out, f"profile-b{args.batch}.txt"), "w") as f:
        f.write(text.getvalue())
    print(text.getvalue()[:20000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
