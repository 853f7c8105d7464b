"""Multi-turn chat against a KV pool smaller than its working set: median TTFT with and without
the prefix cache's host tier (--kv-offload-gb, engine/host_kv_tier.py).

Issue 54's target: 200 conversations x 8 turns, a 1,500-token system prompt every conversation
shares, each turn's prompt the whole history so far (system, earlier user turns and the
engine's own answers) plus a new user message; conversations start as a Poisson process and
each next turn arrives a think time after the previous answer. The GPU pool is limited to a
fraction of the working set (every conversation's final history at once, the system prompt
counted once), so finished turns' blocks are evicted before their conversation returns: without
the tier the history is recomputed, with it the blocks come back from host memory.

One engine in this process per mode, the same arrivals and token ids for both; prints and saves
(--out) per mode: median / P90 TTFT, output tokens/s, prefill tokens computed, prefix hits by tier.

    # the issue's run (H200, Llama-3-8B shape, dummy weights)
    python benchmarks/multi_turn_prefix.py --model llama-3-8b --load-format dummy \\
        --pool-fraction 0.4 --rate 2 --kv-offload-gb 32 --out results.json
    # smoke test on the CPU: a tiny random Llama
    python benchmarks/multi_turn_prefix.py --tiny --conversations 6 --turns 3 --system-len 64 \\
        --user-len 16 --answer-len 8 --rate 4 --think-s 0.05
"""

from __future__ import annotations

import argparse
import gc
import heapq
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


def run_mode(args, model: str, load_format: str, offload_gb: float, num_blocks: int) -> dict:
    engine = LLMEngine.from_kwargs(
        model=model, load_format=load_format, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=num_blocks, kv_offload_gb=offload_gb, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, enable_prefix_caching=True)
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    system = [rng.randrange(1, vocab) for _ in range(args.system_len)]
    users = [[[rng.randrange(1, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    arrivals, t = [], 0.0
    for c in range(args.conversations):
        t += rng.expovariate(args.rate)
        arrivals.append((t, c, 0))
    think = random.Random(args.seed + 1)
    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True, output_kind="final")
    histories = [list(system) for _ in range(args.conversations)]
    prefill_tokens = []
    engine.add_observer(lambda report: prefill_tokens.append(report.shape.prefill_tokens))
    # Warm-up outside the clock: a request of other ids, so graphs and kernels are ready.
    engine.add_request("warmup", [rng.randrange(1, vocab) for _ in range(64)], params)
    while engine.has_unfinished_requests():
        engine.step()
    prefill_tokens.clear()
    snap0 = engine.snapshot()
    heapq.heapify(arrivals)
    ttfts, out_tokens, t0 = [], 0, time.monotonic()
    while arrivals or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while arrivals and arrivals[0][0] <= now:
            at, c, turn = heapq.heappop(arrivals)
            histories[c].extend(users[c][turn])
            engine.add_request(f"c{c}t{turn}", list(histories[c]), params, arrival_time=t0 + at)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[0][0] - now, 0.05)))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            c, turn = (int(x) for x in out.request_id[1:].split("t"))
            answer = out.outputs[0].token_ids
            histories[c].extend(answer)
            out_tokens += len(answer)
            ttfts.append(out.first_token_time - out.arrival_time)
            if turn + 1 < args.turns:
                heapq.heappush(arrivals, (time.monotonic() - t0 + think.expovariate(1 / args.think_s), c, turn + 1))
    makespan = time.monotonic() - t0
    snap = engine.snapshot()
    hits = snap.prefix_hit_tokens - snap0.prefix_hit_tokens
    host_hits = snap.prefix_host_hit_tokens - snap0.prefix_host_hit_tokens
    result = {
        "kv_offload_gb": offload_gb, "num_gpu_blocks": num_blocks,
        "num_offload_blocks": engine.info.num_offload_blocks, "requests": len(ttfts),
        "median_ttft_s": statistics.median(ttfts), "p90_ttft_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
        "output_tokens_per_s": out_tokens / makespan, "makespan_s": makespan,
        "prefill_tokens_computed": sum(prefill_tokens), "prefix_hit_tokens_device": hits - host_hits,
        "prefix_hit_tokens_host": host_hits, "blocks_restored": snap.num_restored_blocks,
        "preemptions": snap.num_preemptions - snap0.num_preemptions,
    }
    engine.shutdown()
    del engine
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return result


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
    p.add_argument("--user-len", type=int, default=100, help="tokens of each user message")
    p.add_argument("--answer-len", type=int, default=100, help="tokens of each answer (ignore_eos)")
    p.add_argument("--rate", type=float, default=2.0, help="conversations started per second (Poisson)")
    p.add_argument("--think-s", type=float, default=2.0, help="mean think time between turns (exponential)")
    p.add_argument("--block-size", type=int, default=None, help="unset: the engine's default for the device")
    p.add_argument("--pool-fraction", type=float, default=0.4, help="GPU pool over the working set")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="the GPU pool in blocks")
    p.add_argument("--kv-offload-gb", type=float, default=16.0, help="the host tier of the run with one")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--modes", default="off,on", help="off: --kv-offload-gb 0; on: the tier")
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
    longest = args.system_len + args.turns * (args.user_len + args.answer_len)
    args.max_model_len = args.max_model_len or longest + 16
    num_blocks = args.num_gpu_blocks_override or max(
        int(args.pool_fraction * working_set_blocks(args)), -(-longest // args.block_size) + 2)
    print(f"working set {working_set_blocks(args)} blocks of {args.block_size}; GPU pool {num_blocks} blocks")
    results = {}
    for mode in args.modes.split(","):
        offload = 0.0 if mode == "off" else args.kv_offload_gb
        results[mode] = r = run_mode(args, model, load_format, offload, num_blocks)
        print(f"{mode:>3}: median TTFT {1e3 * r['median_ttft_s']:.1f} ms, P90 {1e3 * r['p90_ttft_s']:.1f} ms, "
              f"{r['output_tokens_per_s']:.1f} output tok/s, prefill computed {r['prefill_tokens_computed']:,}, "
              f"hits device {r['prefix_hit_tokens_device']:,} / host {r['prefix_hit_tokens_host']:,} tokens, "
              f"{r['preemptions']} preemptions")
    if "off" in results and "on" in results:
        print(f"median TTFT without / with the tier: "
              f"{results['off']['median_ttft_s'] / max(results['on']['median_ttft_s'], 1e-9):.2f}x; output tok/s "
              f"{results['on']['output_tokens_per_s'] / max(results['off']['output_tokens_per_s'], 1e-9):.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
