"""Multi-turn chat against a KV pool smaller than its working set: median TTFT with and without
the prefix cache's host tier (--kv-offload-gb, engine/host_kv_tier.py). Issue 54's target 1.

The workload the issue fixes: 200 conversations x 8 turns, a 1,500-token system prompt every
conversation shares, each turn's prompt the whole history so far (system, earlier user turns
and the engine's own answers) plus a new user message; the GPU pool is ~40% of the working set
(every conversation's final history, the system prompt once), in blocks, as vLLM's
--num-gpu-blocks-override would set it (rooflm's --num-blocks); arrivals are Poisson at a rate
the GPU-only cache serves at ~70% load.

Turns arrive as one Poisson process of rate `rate` (turns/s) and go round robin over the
conversations: arrival i is turn i // C of conversation i mod C (sent when its previous answer
is in, if that is later). Every conversation stays live for the whole run, so the working set
is all of them at once, and between two turns of one conversation the other C - 1 have had
theirs: with the pool at 40% its blocks are evicted by then. Without the tier the history is
recomputed; with it the blocks come back from host memory.

The rate: `--load` times the GPU-only capacity, measured first in the same process on the
tier-less engine (a saturating burst of turns shaped like the run's: the system prompt cached,
the history recomputed; completions per second between the 10th and 90th percentile of the
burst's finish times). `--rate` sets it instead.

Not fixed by the issue and chosen to fit one ~3 minute A/B on an H200 (both engines' start,
the capacity burst, two runs of 1,600 turns): user messages and answers of 48 tokens each
(`--user-len`, `--answer-len`), so a conversation's history grows to 768 tokens over its 8 turns.

One engine per mode in this process, the same arrivals and token ids for both; prints a table
with the targets (median TTFT >= 3x lower with the tier; output tokens/s not lower) and writes
JSON (--out).

    # the issue's run (H200, Llama-3-8B shape, dummy weights)
    python benchmarks/multi_turn_prefix.py --model llama-3-8b --load-format dummy --out mt.json
    # smoke test on the CPU (numbers mean nothing)
    python benchmarks/multi_turn_prefix.py --model smollm2-135m --load-format dummy --device cpu \\
        --conversations 6 --turns 3 --system-len 64 --user-len 16 --answer-len 8 --kv-offload-gb 0.05
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm import SamplingParams  # noqa: E402
from rooflm.engine.llm_engine import LLMEngine  # noqa: E402

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": False,
}
TARGET_TTFT_RATIO = 3.0  # median TTFT without the tier / with it
TARGET_TPS_RATIO = 1.0  # output tokens/s with the tier / without


def tiny_model_dir() -> str:
    path = tempfile.mkdtemp(prefix="rooflm-tiny-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    return path


def working_set_blocks(args) -> int:
    """Blocks that hold every conversation's final history at once, the system prompt once."""
    history = args.turns * (args.user_len + args.answer_len)
    per_conv = -(-history // args.block_size) + 1  # + the block the system prompt's tail shares
    return -(-args.system_len // args.block_size) + args.conversations * per_conv


def make_engine(args, model: str, load_format: str, offload_gb: float, num_blocks: int) -> LLMEngine:
    return LLMEngine.from_kwargs(
        model=model, load_format=load_format, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=num_blocks, kv_offload_gb=offload_gb, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, enable_prefix_caching=True)


class Workload:
    """The token ids of every conversation, the same for both modes (seeded)."""

    def __init__(self, args, vocab: int):
        rng = random.Random(args.seed)
        self.system = [rng.randrange(1, vocab) for _ in range(args.system_len)]
        self.users = [[[rng.randrange(1, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
                      for _ in range(args.conversations)]
        self.rng = rng
        self.vocab = vocab


def drain(engine: LLMEngine) -> list:
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    return finished


def measure_capacity(engine: LLMEngine, args, work: Workload) -> dict:
    """Turns/s the engine sustains when saturated with turns shaped like the run's on a cache
    that holds only the system prompt: turn k's prompt is the system prompt (a hit) plus k
    earlier exchanges and a user message of fresh ids (computed), its answer answer_len tokens.
    One request per conversation, turns spread evenly, all queued at once."""
    rng = random.Random(args.seed + 7)
    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True, output_kind="final")
    n = args.capacity_requests or args.conversations
    t0 = time.monotonic()
    for i in range(n):
        k = i % args.turns
        history = [rng.randrange(1, work.vocab) for _ in range(k * (args.user_len + args.answer_len) + args.user_len)]
        engine.add_request(f"cap{i}", work.system + history, params, arrival_time=t0)
    done = []
    while engine.has_unfinished_requests():
        now = time.monotonic()
        done.extend(now - t0 for o in engine.step() if o.finished)
    done.sort()
    lo, hi = int(0.1 * (len(done) - 1)), int(0.9 * (len(done) - 1))
    # The middle of the burst (ramp-up and the last wave's drain left out), unless that window
    # is short: a small burst finishing in one wave would read as an absurd rate.
    if hi > lo and done[hi] - done[lo] >= 0.25 * done[-1]:
        turns_per_s = (hi - lo) / (done[hi] - done[lo])
    else:
        turns_per_s = len(done) / done[-1]
    return {"requests": n, "makespan_s": done[-1], "turns_per_s": turns_per_s}


def run_mode(engine: LLMEngine, args, work: Workload, rate: float) -> dict:
    """The round-robin Poisson run at `rate` turns/s; per-turn TTFT from the time it was sent."""
    C, T = args.conversations, args.turns
    arrivals, t, gaps = [], 0.0, random.Random(args.seed + 1)
    for _ in range(C * T):
        t += gaps.expovariate(rate)
        arrivals.append(t)
    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True, output_kind="final")
    histories = [list(work.system) for _ in range(C)]
    answered = [True] * C  # the conversation's previous turn is in
    prefill_tokens = []
    engine.add_observer(lambda report: prefill_tokens.append(report.shape.prefill_tokens))
    snap0 = engine.snapshot()
    ttfts, out_tokens, nxt, late = [], 0, 0, 0
    t0 = time.monotonic()
    while nxt < len(arrivals) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while nxt < len(arrivals) and arrivals[nxt] <= now and answered[nxt % C]:
            c, turn = nxt % C, nxt // C
            histories[c].extend(work.users[c][turn])
            sent = t0 + arrivals[nxt]
            if now - arrivals[nxt] > 0.05:  # its previous answer came after its slot: sent now
                sent, late = time.monotonic(), late + 1
            engine.add_request(f"c{c}t{turn}", list(histories[c]), params, arrival_time=sent)
            answered[c] = False
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[nxt] - now, 0.05)))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            c = int(out.request_id[1:].split("t")[0])
            answer = out.outputs[0].token_ids
            histories[c].extend(answer)
            answered[c] = True
            out_tokens += len(answer)
            ttfts.append(out.first_token_time - out.arrival_time)
    makespan = time.monotonic() - t0
    snap = engine.snapshot()
    hits = snap.prefix_hit_tokens - snap0.prefix_hit_tokens
    host_hits = snap.prefix_host_hit_tokens - snap0.prefix_host_hit_tokens
    ttfts.sort()
    return {
        "kv_offload_gb": engine.config.cache.kv_offload_gb, "num_gpu_blocks": engine.info.num_blocks,
        "num_offload_blocks": engine.info.num_offload_blocks, "rate_turns_per_s": rate, "requests": len(ttfts),
        "sent_late": late, "median_ttft_s": statistics.median(ttfts), "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "p99_ttft_s": ttfts[int(0.99 * (len(ttfts) - 1))], "output_tokens_per_s": out_tokens / makespan,
        "makespan_s": makespan, "prefill_tokens_computed": sum(prefill_tokens),
        "prefix_hit_tokens_device": hits - host_hits, "prefix_hit_tokens_host": host_hits,
        "blocks_restored": snap.num_restored_blocks - snap0.num_restored_blocks,
        "preemptions": snap.num_preemptions - snap0.num_preemptions,
    }


def release(engine: LLMEngine) -> None:
    engine.shutdown()
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def offload_gb_for(engine: LLMEngine, args) -> float:
    """Host memory for the whole working set plus a quarter: the tier never drops what the run
    comes back for, and pinning no more than that keeps the engine's start short."""
    per_block = engine.runner.kv_bytes_per_block()
    return 1.25 * working_set_blocks(args) * per_block / 2**30


def table(args, capacity, results) -> str:
    off, on = results.get("off"), results.get("on")
    lines = [f"Multi-turn chat: {args.conversations} conversations x {args.turns} turns, system prompt "
             f"{args.system_len} tokens, user {args.user_len} / answer {args.answer_len} tokens per turn; "
             f"GPU pool {results[next(iter(results))]['num_gpu_blocks']} blocks of {args.block_size} "
             f"({args.pool_fraction:.0%} of the working set, {working_set_blocks(args)} blocks)"]
    if capacity:
        lines.append(f"GPU-only capacity {capacity['turns_per_s']:.1f} turns/s (saturating burst of "
                     f"{capacity['requests']}); run at {args.rate:.2f} turns/s ({args.load:.0%} load)")
    lines += ["", "| | without tier | with tier | ratio | target |", "| --- | --- | --- | --- | --- |"]
    def row(name, key, scale, fmt, ratio_of=None, target=""):
        a = off[key] * scale if off else None
        b = on[key] * scale if on else None
        ratio = ratio_of(off[key], on[key]) if off and on and ratio_of else None
        cell = lambda v: "-" if v is None else format(v, fmt)
        lines.append(f"| {name} | {cell(a)} | {cell(b)} | {'' if ratio is None else f'{ratio:.2f}x'} | {target} |")
    row("median TTFT (ms)", "median_ttft_s", 1e3, ".1f", lambda a, b: a / max(b, 1e-9),
        f">= {TARGET_TTFT_RATIO:g}x lower")
    row("P90 TTFT (ms)", "p90_ttft_s", 1e3, ".1f")
    row("P99 TTFT (ms)", "p99_ttft_s", 1e3, ".1f")
    row("output tokens/s", "output_tokens_per_s", 1, ".1f", lambda a, b: b / max(a, 1e-9), "not lower")
    row("prefill tokens computed", "prefill_tokens_computed", 1, ",")
    row("prefix hits, device (tokens)", "prefix_hit_tokens_device", 1, ",")
    row("prefix hits, host tier (tokens)", "prefix_hit_tokens_host", 1, ",")
    row("blocks restored from host", "blocks_restored", 1, ",")
    row("preemptions", "preemptions", 1, ",")
    row("turns sent after their slot", "sent_late", 1, ",")
    if off and on:
        ttft = off["median_ttft_s"] / max(on["median_ttft_s"], 1e-9)
        tps = on["output_tokens_per_s"] / max(off["output_tokens_per_s"], 1e-9)
        met = ttft >= TARGET_TTFT_RATIO and tps >= TARGET_TPS_RATIO * 0.98  # 2%: the arrival noise
        lines.append(f"\ntarget 1 {'MET' if met else 'MISSED'}: median TTFT {ttft:.2f}x lower with the tier "
                     f"(>= {TARGET_TTFT_RATIO:g}x), output tokens/s {tps:.3f}x (not lower)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="preset name or model directory")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama (CPU smoke test)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1500)
    p.add_argument("--user-len", type=int, default=48, help="tokens of each user message")
    p.add_argument("--answer-len", type=int, default=48, help="tokens of each answer (ignore_eos)")
    p.add_argument("--load", type=float, default=0.7, help="the run's rate over the GPU-only capacity")
    p.add_argument("--rate", type=float, default=None, help="turns/s; unset: --load x the measured capacity")
    p.add_argument("--capacity-requests", type=int, default=None, help="the capacity burst (default: one "
                   "per conversation)")
    p.add_argument("--block-size", type=int, default=None, help="unset: the engine's default for the device")
    p.add_argument("--pool-fraction", type=float, default=0.4, help="GPU pool over the working set")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="the GPU pool in blocks "
                   "(default: --pool-fraction of the working set)")
    p.add_argument("--kv-offload-gb", type=float, default=None, help="the host tier of the run with one "
                   "(default: 1.25x the working set)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--modes", default="off,on", help="off: --kv-offload-gb 0; on: the tier; off first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    model, load_format = args.model, args.load_format
    if args.tiny:
        model, load_format = tiny_model_dir(), "dummy"
        args.device = "cpu" if args.device == "auto" else args.device
        args.dtype = "float32" if args.dtype == "auto" else args.dtype
    if args.block_size is None:
        import torch
        args.block_size = 64 if args.device != "cpu" and torch.cuda.is_available() else 16
    modes = args.modes.split(",")
    if args.rate is None and "off" not in modes:
        p.error("--modes without off needs --rate (the capacity is measured on the tier-less engine)")
    longest = args.system_len + args.turns * (args.user_len + args.answer_len)
    args.max_model_len = args.max_model_len or longest + 16
    num_blocks = args.num_gpu_blocks_override or max(
        int(args.pool_fraction * working_set_blocks(args)), -(-longest // args.block_size) + 2)
    print(f"working set {working_set_blocks(args)} blocks of {args.block_size}; GPU pool {num_blocks} blocks",
          flush=True)
    results, capacity = {}, None
    for mode in modes:
        t0 = time.monotonic()
        offload = 0.0
        if mode == "on":
            offload = args.kv_offload_gb if args.kv_offload_gb is not None else getattr(args, "auto_offload_gb", None)
            if offload is None:
                p.error("--modes with on before off needs --kv-offload-gb")
        engine = make_engine(args, model, load_format, offload, num_blocks)
        if args.kv_offload_gb is None:
            args.auto_offload_gb = offload_gb_for(engine, args)
        work = Workload(args, engine.model_config.vocab_size)
        # Warm-up outside the clock: the system prompt (cached, as in a server that has run a
        # while) and other ids, so graphs and kernels are ready.
        warm = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True, output_kind="final")
        engine.add_request("warmup", work.system + [work.rng.randrange(1, work.vocab) for _ in range(args.user_len)],
                           warm)
        drain(engine)
        print(f"{mode}: engine ready in {time.monotonic() - t0:.1f} s (host tier "
              f"{engine.info.num_offload_blocks} blocks)", flush=True)
        if mode == "off" and args.rate is None:
            capacity = measure_capacity(engine, args, work)
            args.rate = args.load * capacity["turns_per_s"]
            print(f"capacity {capacity['turns_per_s']:.2f} turns/s; run at {args.rate:.2f}", flush=True)
        results[mode] = r = run_mode(engine, args, work, args.rate)
        release(engine)
        del engine
        print(f"{mode:>3}: median TTFT {1e3 * r['median_ttft_s']:.1f} ms, P90 {1e3 * r['p90_ttft_s']:.1f} ms, "
              f"{r['output_tokens_per_s']:.1f} output tok/s, prefill computed {r['prefill_tokens_computed']:,}, "
              f"hits device {r['prefix_hit_tokens_device']:,} / host {r['prefix_hit_tokens_host']:,} tokens, "
              f"{r['preemptions']} preemptions, {r['makespan_s']:.1f} s", flush=True)
        # After each mode: a run cut short by its time limit still leaves the modes it finished.
        report = table(args, capacity, results)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "capacity": capacity, "results": results, "table": report}, f,
                          indent=2)
    print("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
