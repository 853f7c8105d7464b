"""Where a speculative step's time goes, on the GPU: the verify forward alone (its CUDA graph
replayed back to back) against the plain decode graph, and the engine's whole step (host work
included) with every draft accepted.

    python benchmarks/spec_step_breakdown.py --out DIR

Rows: for batch B and width w (1 + k tokens a sequence), the uniform graph's replay time next to
the decode graph's at the same batch (what a verify forward costs beyond a plain step), then the
step's wall time in the engine (launch to results, proposer and scheduler included) with the
replay proposer at 0% corruption, so every step verifies k drafts and accepts them all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rooflm import LLM, SamplingParams  # noqa: E402
from rooflm.spec.replay import ReplayProposer  # noqa: E402


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 30) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_table(loop_graph, uniform_graph, out_dir: str, replays: int = 5) -> None:
    """Device time per kernel name of one replay of the batch-1 loop graph against the host
    path's width-(k+1) uniform graph (what the loop adds around the forward)."""
    from torch.profiler import ProfilerActivity, profile
    tables = {}
    for name, graph in (("loop", loop_graph), ("uniform", uniform_graph)):
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        totals = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                t = totals.setdefault(e.name[:90], [0, 0.0])
                t[0] += 1
                t[1] += e.device_time / 1000
        tables[name] = {k: (n / replays, ms / replays) for k, (n, ms) in totals.items()}
    names = sorted(set(tables["loop"]) | set(tables["uniform"]),
                   key=lambda k: -abs(tables["loop"].get(k, (0, 0))[1] - tables["uniform"].get(k, (0, 0))[1]))
    lines = [f"{'kernel':90s} {'loop n':>7s} {'loop ms':>8s} {'unif n':>7s} {'unif ms':>8s}"]
    for k in names:
        a, b = tables["loop"].get(k, (0, 0.0)), tables["uniform"].get(k, (0, 0.0))
        lines.append(f"{k:90s} {a[0]:7.1f} {a[1]:8.4f} {b[0]:7.1f} {b[1]:8.4f}")
    total = {n: sum(ms for _, ms in t.values()) for n, t in tables.items()}
    lines.append(f"{'total kernel time':90s} {'':7s} {total['loop']:8.4f} {'':7s} {total['uniform']:8.4f}")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "loop_kernels.txt"), "w") as f:
        f.write(text + "\n")
    print("\n".join(lines[:25] + lines[-1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 48])
    ap.add_argument("--kernels", action="store_true",
                    help="also a per-kernel table of the batch-1 loop graph against the uniform graph")
    ap.add_argument("--out", default="benchmarks/results/spec-breakdown")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    max_batch = max(args.batches)
    llm = LLM(model=args.model, load_format="dummy", max_model_len=512, max_num_seqs=max_batch,
              cuda_graph_max_batch=max_batch, speculative_method="ngram", num_speculative_tokens=args.k,
              speculative_policy="budget")  # every step verifies: the rows time verify steps
    runner = llm.engine.runner
    rows = []
    for (width, size), graph in sorted(runner.uniform_graphs.graphs.items()):
        if size in args.batches:
            rows.append({"what": "graph replay", "batch": size, "width": width, "ms": replay_ms(graph)})
    for size in args.batches:
        if size in runner.graphs.graphs:
            rows.append({"what": "graph replay", "batch": size, "width": 1, "ms": replay_ms(runner.graphs.graphs[size])})
    loop = llm.engine.spec_loop
    if loop is not None:
        loop.active.zero_()  # empty slots: the same kernels, no K/V written, no history moved
        for size in args.batches:
            for sampled in (False, True):
                if (size, sampled) in loop.graphs:
                    rows.append({"what": "loop graph replay" + (", sampled" if sampled else ""), "batch": size,
                                 "width": args.k + 1, "ms": replay_ms(loop.graphs[(size, sampled)])})
        if args.kernels and (1, False) in loop.graphs and (args.k + 1, 1) in runner.uniform_graphs.graphs:
            kernel_table(loop.graphs[(1, False)], runner.uniform_graphs.graphs[(args.k + 1, 1)], args.out)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    plain = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for b in args.batches:
        prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(b)]
        spec = llm.engine.spec
        ngram = spec.proposer
        # The continuation to replay: the spec engine's own output (its verify numerics).
        outs = llm.generate(prompts, plain)
        truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
        for _ in range(2):
            spec.set_proposer(ReplayProposer(truth, 0.0, vocab))
            before = llm.engine.snapshot().spec
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, plain)
            seconds = time.perf_counter() - t0
            after = llm.engine.snapshot().spec
            truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
        drafts = after.num_drafts - before.num_drafts
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        steps = drafts / b
        rows.append({"what": "engine step, all accepted", "batch": b, "width": args.k + 1,
                     "ms": 1000 * seconds / max(steps, 1), "steps": steps,
                     "mean_accepted_length": 1 + accepted / max(drafts, 1),
                     "verify_ms": 1000 * (after.verify_s - before.verify_s) / max(steps, 1),
                     "draft_ms": 1000 * (after.draft_s - before.draft_s) / max(steps, 1)})
        spec.set_proposer(ngram)
    for r in rows:
        print(json.dumps(r))
    with open(os.path.join(args.out, "spec_breakdown.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'what':28s} {'batch':>5s} {'width':>5s} {'ms':>8s}")
    for r in rows:
        print(f"{r['what']:28s} {r['batch']:5d} {r['width']:5d} {r['ms']:8.3f}"
              + (f"  (verify {r['verify_ms']:.3f} ms, propose {r['draft_ms']:.3f} ms, "
                 f"accepted length {r['mean_accepted_length']:.2f})" if "verify_ms" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
