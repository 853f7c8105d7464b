"""Where a batch-1 CPU decode step of the default model goes: the decoder layers (native C
decoder, and the torch path it replaces), their matmuls alone, the LM head, and the engine
around them (scheduling, sampling, detokenizing).

    python benchmarks/cpu_decode_breakdown.py --threads 2 [--context 64] [--reps 100] [--out DIR]

Each number is the median of --reps timed calls after warm-up (time.perf_counter):
  layers, native      one NativeDecoder.forward of one token at position --context, over all
                      layers (embedding lookup and final norm included), on a private KV pool;
  layers, torch       the same step down the torch path (ROOFLM_NATIVE_DECODE=0's path);
  matmuls alone       the four block matmuls of every layer for one token, each its own ctypes
                      call (so a few microseconds of call overhead each are in it);
  rest of layers      layers, native - matmuls alone: norms, rotary, cache write, attention;
  LM head             compute_logits of one hidden state (the tied Q8_0 embedding, 49152 rows);
  engine, end to end  LLM.generate of --output-len greedy tokens / tokens (prefill included);
  engine rest         end to end - layers, native - LM head: scheduler, input tensors, sampler,
                      detokenizer, Python.
Prints a table and, with --out, writes cpu_decode_breakdown.{json,md} there. On a shared
machine the numbers move with the load; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, reps: int, warmup: int = 5) -> float:
    """Median milliseconds of fn() over reps calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=64, help="tokens already in the cache")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from rooflm import LLM, SamplingParams
    from rooflm.layers.attention import AttentionMetadata
    from rooflm.layers.kv_cache import KVCache

    llm = LLM(device="cpu")
    model = llm.engine.runner.model  # LlamaForCausalLM
    decoder_model = model.model
    decoder_model.choose_decoder_path()  # otherwise made at the first forward
    decoder = decoder_model.native_decoder
    if decoder is None:
        from rooflm.quant.native_decode import unsupported_reason
        print(f"the native decoder is off here ({unsupported_reason(decoder_model)}): nothing to break down")
        return 1
    cfg = model.cfg
    block_size = 16
    num_blocks = -(-(args.context + 1) // block_size)
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [KVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(num_blocks, dtype=torch.int32)[None]

    def meta(start: int, count: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + count), query_start_loc=torch.tensor([0, count], dtype=torch.int32),
            seq_lens=torch.tensor([start + count], dtype=torch.int32), block_tables=table, max_query_len=count,
            max_seq_len=start + count, num_decodes=int(count == 1), query_start_loc_cpu=[0, count],
            seq_lens_cpu=[start + count])

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.context,), generator=gen)
    with torch.inference_mode():
        decoder.forward(prompt, torch.arange(args.context), caches, meta(0, args.context))
        token, position = torch.tensor([17]), torch.tensor([args.context])
        step_meta = meta(args.context, 1)
        rows = {}
        rows["layers, native"] = timed(lambda: decoder.forward(token, position, caches, step_meta), args.reps)
        decoder_model.native_decoder = None  # the torch path, for one measurement
        try:
            rows["layers, torch path"] = timed(lambda: decoder_model(token, position, caches, meta(args.context, 1)),
                                               args.reps)
        finally:
            decoder_model.native_decoder = decoder
        linears = []
        for layer in decoder_model.layers:
            linears += [layer.self_attn.qkv_proj.quant, layer.self_attn.o_proj.quant,
                        layer.mlp.gate_up_proj.quant, layer.mlp.down_proj.quant]
        inputs = [torch.randn(1, lin.in_features, generator=gen) for lin in linears]

        def matmuls():
            for lin, x in zip(linears, inputs):
                lin(x)
        rows["matmuls alone"] = timed(matmuls, args.reps)
        rows["rest of layers (norms, rotary, KV write, attention)"] = rows["layers, native"] - rows["matmuls alone"]
        hidden = torch.randn(1, cfg.hidden_size, generator=gen)
        rows["LM head"] = timed(lambda: model.compute_logits(hidden), args.reps)

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ids = prompt.tolist()[:32]
    llm.generate(ids, params)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(ids, params)
        runs.append((time.perf_counter() - t0) * 1e3 / args.output_len)
    rows["engine, end to end per token"] = statistics.median(runs)
    rows["engine rest (scheduler, sampler, detokenizer, Python)"] = (
        rows["engine, end to end per token"] - rows["layers, native"] - rows["LM head"])
    load = os.getloadavg()[0]

    lines = [f"# CPU decode step breakdown, SmolLM2-135M (default model), {args.threads} threads, "
             f"context {args.context}", "",
             f"1-minute load average at the end: {load:.2f} (2 cores: above ~2 means shared).", "",
             "| part | ms per token |", "| --- | --- |"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in rows.items()]
    lines += ["", f"End to end: {1e3 / rows['engine, end to end per token']:.1f} tokens/s "
              f"(32 in / {args.output_len} out, prefill included)."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cpu_decode_breakdown.md").write_text(text + "\n")
        (out / "cpu_decode_breakdown.json").write_text(json.dumps(
            {"threads": args.threads, "context": args.context, "load_avg_1m": load, "ms": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
