"""Speculative decoding on the GPU: speedup over plain decoding as a function of acceptance.

Dummy weights give real proposers near-zero acceptance, so the mechanism is measured with the
replay proposer (rooflm/spec/replay.py): it proposes the target's own greedy continuation with
a set fraction of output positions corrupted, so a draft matches with probability about
1 - corrupt ("per-token acceptance" below). The continuation comes from the plain run; each
repeat then replays the previous repeat's own output, until the output is the one replayed (at
most --max-repeats), so that near-ties the verify forward breaks differently from the decode
forward (bf16) stop costing acceptance. Measured acceptance is printed beside the set one, with
the repeats taken and whether the fixed point was reached.

Rows (batch B, k drafts, 128 in / 256 out by default, greedy, ignore_eos):
  plain             the engine without speculation (its defaults: async scheduling, graphs)
  ngram-replay@a    the n-gram engine with the replay proposer at per-token acceptance a
                    (proposing costs ~nothing, as for n-gram)
  ngram-real        the n-gram proposer itself on dummy weights (its real overhead; acceptance
                    is whatever the random model's repetitions give)
  draft-replay@a    the draft-model engine (1B shape): the draft model runs every step (its
                    cost is paid), then its drafts are replaced by the replay's
  draft-real        the draft model's own drafts (dummy weights: acceptance near zero)
  *-k4-forced       batch 64 only: the batch policy off (k = 4 whatever the batch), to show why
                    the policy shortens k there

    python benchmarks/spec_decode.py --out benchmarks/results/spec-h100
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm import LLM, SamplingParams  # noqa: E402
from rooflm.perf.results import git_commit  # noqa: E402
from rooflm.spec.proposer import Proposal, Proposer  # noqa: E402
from rooflm.spec.replay import ReplayProposer  # noqa: E402


class DraftCostReplay(Proposer):
    """The draft model runs (its time is paid), then the replay's drafts are used."""

    name = "draft+replay"

    def __init__(self, draft: Proposer, replay: ReplayProposer):
        self.draft, self.replay = draft, replay

    def propose(self, batch) -> Proposal:
        self.draft.propose(batch)
        return self.replay.propose(batch)


def sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm: LLM, prompts, params) -> tuple[float, list[list[int]]]:
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def spec_delta(llm: LLM, before):
    after = llm.engine.snapshot().spec
    drafts = after.num_drafts - (before.num_drafts if before else 0)
    draft_tokens = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
    accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "draft_s": after.draft_s - (before.draft_s if before else 0.0),
            "verify_s": after.verify_s - (before.verify_s if before else 0.0)}


def release_memory() -> None:
    """After the caller dropped its engine: collect it and hand its blocks back to the device."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--draft-model", default="llama-3.2-1b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--acceptances", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs of plain and real variants; "
                    "replay variants run at least this many")
    ap.add_argument("--max-repeats", type=int, default=6,
                    help="replay variants rerun until their output is the one replayed, at most this often")
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--policy", default="adaptive", choices=("adaptive", "budget"),
                    help="--speculative-policy of the speculating engines; each variant starts with "
                         "a fresh policy, so one variant's acceptance does not decide the next's steps")
    ap.add_argument("--deterministic", action="store_true",
                    help="every engine with --deterministic: plain and verify forwards then break "
                         "near-ties alike, so a replay's acceptance is the set one (a check of the "
                         "mechanism, at the deterministic kernels' speed)")
    ap.add_argument("--replay-seeds", type=int, default=1,
                    help="corruption patterns per acceptance (ReplayProposer seeds 0..N-1): one "
                         "prompt's pattern gives a mean accepted length off the expectation "
                         "(3.11 for 3.36 at 80%%), several average it out")
    ap.add_argument("--device-loop", default="auto", choices=("auto", "off", "both"),
                    help="the n-gram engine's speculative_device_loop: auto (on with CUDA graphs), "
                         "off (every verify step through the host), both (one engine each; the host "
                         "path's rows are labelled ngram-host)")
    ap.add_argument("--out", default="benchmarks/results/spec")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    max_batch = max(args.batches)
    blocks = max_batch * -(-(args.input_len + args.output_len + 2 * args.k) // 16) + 64
    common = dict(model=args.model, load_format="dummy", max_model_len=args.input_len + args.output_len + 64,
                  num_blocks=blocks, block_size=16, max_num_seqs=max_batch, cuda_graph_max_batch=max_batch,
                  deterministic=args.deterministic)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rows, truth = [], {}

    def record(name, batch, seconds, extra=None):
        tokens = batch * args.output_len
        row = {"variant": name, "batch": batch, "seconds": seconds, "tok_s": tokens / seconds}
        row.update(extra or {})
        rows.append(row)
        print(json.dumps(row), flush=True)

    # ---- plain ------------------------------------------------------------------------------
    llm = LLM(**common)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(vocab // 8, vocab) for _ in range(args.input_len)] for _ in range(b)]
               for b in args.batches}
    for b in args.batches:
        llm.generate(prompts[b], warm)
        best = None
        for _ in range(args.repeats):
            seconds, outs = timed(llm, prompts[b], params)
            best = seconds if best is None else min(best, seconds)
        truth[b] = outs
        record("plain", b, best)
    llm = None
    release_memory()

    def replay_runs(llm, label, b, make_proposer, original):
        for a in args.acceptances:
            for seed in range(args.replay_seeds):
                llm.engine.spec.reset_policy()
                continuation = {tuple(p): o for p, o in zip(prompts[b], truth[b])}
                # Replay until the output is the one replayed (a fixed point): then only the set
                # corruption rejects drafts, not near-ties the verify forward breaks differently.
                for repeat in range(1, args.max_repeats + 1):
                    llm.engine.spec.set_proposer(make_proposer(ReplayProposer(continuation, 1 - a, vocab, seed)))
                    before = llm.engine.snapshot().spec
                    seconds, outs = timed(llm, prompts[b], params)
                    stats = spec_delta(llm, before)
                    replayed, continuation = continuation, {tuple(p): o for p, o in zip(prompts[b], outs)}
                    if repeat >= args.repeats and continuation == replayed:
                        break
                stats.update(repeats=repeat, fixed_point=continuation == replayed, seed=seed)
                name = f"{label}-replay@{a:.2f}" + (f"-seed{seed}" if args.replay_seeds > 1 else "")
                record(name, b, seconds, stats)
        llm.engine.spec.set_proposer(original)

    def real_run(llm, label, b):
        llm.engine.spec.reset_policy()
        before = llm.engine.snapshot().spec
        seconds, _ = timed(llm, prompts[b], params)
        record(f"{label}-real", b, seconds, spec_delta(llm, before))

    def forced_k(llm):
        spec = llm.engine.spec
        spec.cfg = dataclasses.replace(spec.cfg, speculative_max_batch_tokens=1 << 30)

    # ---- n-gram engine -------------------------------------------------------------------------
    loops = {"auto": [None], "off": [False], "both": [None, False]}[args.device_loop]
    for loop in loops:
        label = "ngram" if loop is None or args.device_loop == "off" else "ngram-host"
        llm = LLM(**common, speculative_method="ngram", num_speculative_tokens=args.k,
                  speculative_policy=args.policy, speculative_device_loop=loop)
        ngram = llm.engine.spec.proposer
        policy_cfg = llm.engine.spec.cfg
        for b in args.batches:
            llm.generate(prompts[b], warm)
            real_run(llm, label, b)
            replay_runs(llm, label, b, lambda r: r, ngram)
            if b > 1:
                forced_k(llm)
                replay_runs(llm, f"{label}-k4-forced", b, lambda r: r, ngram)
                llm.engine.spec.cfg = policy_cfg
        if llm.engine.spec_loop is not None:
            print(json.dumps({"variant": label, "loop_steps": llm.engine.spec_loop.num_steps,
                              "loop_entries": llm.engine.spec_loop.num_entries}), flush=True)
        llm = ngram = None
        release_memory()

    # ---- draft-model engine --------------------------------------------------------------------
    if not args.skip_draft:
        llm = LLM(**common, speculative_method="draft", num_speculative_tokens=args.k,
                  draft_model=args.draft_model, draft_load_format="dummy", speculative_policy=args.policy)
        draft = llm.engine.spec.proposer
        policy_cfg = llm.engine.spec.cfg
        for b in args.batches:
            llm.generate(prompts[b], warm)
            real_run(llm, "draft", b)
            replay_runs(llm, "draft", b, lambda r: DraftCostReplay(draft, r), draft)
            if b > 1:
                forced_k(llm)
                replay_runs(llm, "draft-k4-forced", b, lambda r: DraftCostReplay(draft, r), draft)
                llm.engine.spec.cfg = policy_cfg
        llm = draft = None
        release_memory()

    plain = {r["batch"]: r["tok_s"] for r in rows if r["variant"] == "plain"}
    for r in rows:
        r["speedup"] = r["tok_s"] / plain[r["batch"]]
    meta = {"model": args.model, "draft_model": args.draft_model, "k": args.k,
            "policy": args.policy, "deterministic": args.deterministic, "input_len": args.input_len,
            "output_len": args.output_len, "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    try:
        import torch
        meta["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        pass
    with open(os.path.join(args.out, "spec_decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# speculative decoding, {meta.get('device')}, {args.model} (dummy), draft {args.draft_model}, "
             f"k={args.k}, {args.input_len} in / {args.output_len} out, commit {meta['commit']}", "",
             "| variant | batch | tok/s | speedup | acceptance | mean accepted length | draft s | verify s | repeats |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['batch']} | {r['tok_s']:.0f} | {r['speedup']:.2f}x | "
                     f"{r.get('acceptance_rate', float('nan')):.2f} | "
                     f"{r.get('mean_accepted_length', float('nan')):.2f} | "
                     f"{r.get('draft_s', 0):.2f} | {r.get('verify_s', 0):.2f} | "
                     f"{r.get('repeats', '')}{'' if r.get('fixed_point', True) else ' (moving)'} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "spec_decode.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
