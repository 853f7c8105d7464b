"""`rooflm bench latency`: how long one batch of requests takes, prefill and decode apart.

Each iteration submits --batch-size B requests of --input-len P random token
ids (fresh ids every iteration, so the prefix cache cannot serve a prompt seen
before) with ignore_eos and max_tokens --output-len N, and steps the engine
until all are done. Per iteration it measures:

  TTFT   time to first token: submit -> every request of the batch has its
         first token, i.e. the batch's prefill is done (it may span several
         steps when B*P exceeds the scheduler's token budget)
  TPOT   time per output token after the first: (E2E - TTFT) / (N - 1); each
         decode step gives every sequence one token, so this is the decode
         step time
  E2E    end-to-end latency: submit -> the last token of the batch
  output tokens/s   B * N / E2E

and reports the medians over --num-iters iterations after --num-iters-warmup
warm-up ones (which absorb one-time costs: kernel compilation, allocator
growth, caches). Several --input-len values (or `sweep`) repeat that for each
prompt length on the one engine: TTFT against context length.

The TTFT floor is the prefill at the device's roofs: the prompts cut into the
scheduler's chunks (--max-num-batched-tokens per step, first come first
served, as the scheduler cuts them), each chunk's operations (its GEMMs, its
attention over the cached prefix and itself) at the floor of their own roof,
summed. It needs the device's FLOP rates, so a CPU run given only
--cpu-bandwidth-gbs has none.

MBU, the model bandwidth utilization of decode: a decode step must read every
weight and the K/V of every sequence's context at least once. Those bytes come
from the roofline model (`rooflm.perf.roofline.step_cost`) for a decode batch
of B sequences at the mean context of the decode steps: step k (k = 1..N-1)
attends P + k positions, on average P + N/2. Then

  MBU = bytes per decode step / TPOT / peak memory bandwidth

An MBU of 1 would be a decode step at the bandwidth floor. On CUDA the peak
comes from --gpu (a table entry, or "measure"); by default the H100 datasheet
on an H100 and a measurement elsewhere. On the CPU the bandwidth is measured
(perf/gpus.py, the same measurement `rooflm profile` uses) unless
--cpu-bandwidth-gbs says what the memory system delivers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, TextIO

# torch is imported inside the functions that run an engine: the CLI builds this parser for
# `rooflm --help` and every other command, which must not pay for importing torch.
from rooflm.engine_args import add_engine_args, engine_kwargs


@dataclass
class IterationResult:
    """What one iteration measured; times in seconds."""

    ttft_s: float
    tpot_s: Optional[float]  # None when there is no token after the first (N = 1)
    e2e_s: float
    output_tokens: int
    steps: int
    cached_prompt_tokens: int  # prompt tokens the prefix cache served: should be 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.e2e_s


def register(subparsers) -> None:
    """Add the `latency` subcommand to the subparsers of `rooflm bench`."""

    p = subparsers.add_parser(
        "latency", help="TTFT, TPOT, end-to-end latency and MBU of one batch of requests",
        description="Submit one batch of random-token requests to the offline engine, repeatedly, "
                    "and report median TTFT, TPOT, end-to-end latency, output tokens/s and the "
                    "model bandwidth utilization (MBU) of the decode steps.")
    g = p.add_argument_group("benchmark options")
    g.add_argument("--batch-size", type=int, default=8, help="requests per batch (default 8)")
    g.add_argument("--input-len", nargs="+", default=["32"], metavar="N",
                   help="prompt tokens per request (default 32). Several lengths, or 'sweep' "
                        "(128, 256, ... doubling up to --max-model-len minus --output-len), "
                        "measure each in turn and print TTFT and TPOT against context length, "
                        "each beside its roofline floor")
    g.add_argument("--output-len", type=int, default=128,
                   help="output tokens per request, EOS ignored (default 128)")
    g.add_argument("--num-iters", type=int, default=10, help="measured iterations (default 10)")
    g.add_argument("--num-iters-warmup", type=int, default=2,
                   help="iterations run first and not measured (default 2)")
    g.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompt token ids")
    g.add_argument("--gpu", default=None,
                   help="peak bandwidth for MBU on CUDA: a GPU table key (h100, a100, ...) or "
                        "'measure' (default: h100 datasheet on an H100 SXM, else measure)")
    g.add_argument("--cpu-bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth of the CPU in GB/s, for MBU of a CPU run (default: "
                        "measured on this CPU before the run)")
    g.add_argument("--output-json", default=None, help="write the result to this JSON file")
    g.add_argument("--output-md", default=None, help="write a markdown summary to this file")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(p)
    p.set_defaults(func=run_latency)


# ---------------------------------------------------------------- one iteration


def random_prompts(rng: random.Random, batch_size: int, input_len: int,
                   vocab_size: int) -> list[list[int]]:
    # Ids from 100 up skip the special and byte tokens at the start of most vocabularies
    # (a tiny test vocabulary may have fewer than 200 ids: then start at half of it).
    low = min(100, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def run_iteration(engine, prompts: list[list[int]], params, tag: str) -> IterationResult:
    """Submit the batch at once, step until every request is done, and time it."""
    import torch
    from rooflm.perf.results import synchronize

    device = torch.device(engine.info.device)
    synchronize(device)
    start = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    first_token_at: dict[str, float] = {}
    final = {}
    steps = 0
    now = start
    while engine.has_unfinished_requests():
        # No device sync here: step() returns tokens only once the step that made them is
        # done, and a sync would also wait for the step async scheduling has queued behind it.
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            if out.request_id not in first_token_at and out.outputs and out.outputs[0].token_ids:
                first_token_at[out.request_id] = now
            if out.finished:
                final[out.request_id] = out
    missing = [i for i in ids if i not in final]
    if missing:
        raise RuntimeError(f"the engine stopped with {len(missing)} requests unfinished: {missing[:3]}")
    ttft = max(first_token_at[i] for i in ids) - start
    e2e = now - start
    num_output = sum(len(final[i].outputs[0].token_ids) for i in ids)
    tokens_per_request = num_output // len(ids)
    tpot = (e2e - ttft) / (tokens_per_request - 1) if tokens_per_request > 1 else None
    cached = sum(final[i].num_cached_tokens for i in ids)
    return IterationResult(ttft, tpot, e2e, num_output, steps, cached)


# ---------------------------------------------------------------- MBU


def decode_step_cost(engine, batch_size: int, input_len: int, output_len: int):
    """FLOPs and bytes of the mean decode step: B sequences at context P + N/2."""
    import torch
    from rooflm.perf.results import compute_dtype_name
    from rooflm.perf.roofline import step_cost

    info = engine.info
    config = info.model_config
    mean_context = input_len + output_len / 2
    if config.sliding_window:
        mean_context = min(mean_context, config.sliding_window)
    # Weights as stored (quantized blocks count their bytes); activations in the engine's dtype.
    act = info.act_dtype_bytes or info.weight_dtype_bytes
    return step_cost(config, num_decode_seqs=batch_size,
                     decode_context_tokens=round(batch_size * mean_context),
                     weight_bytes=info.weight_dtype_bytes, kv_bytes=info.kv_dtype_bytes, act_bytes=act,
                     head_bytes=info.head_dtype_bytes or None, tp=info.tensor_parallel_size,
                     compute_dtype=info.matmul_dtype or compute_dtype_name(getattr(torch, info.dtype)))


def mbu_fields(step, tpot_s: Optional[float], gpu) -> dict:
    """Bytes per decode step, its bandwidth floor and the MBU, or n/a (None) where unknown."""
    fields = {
        "decode_bytes_per_step": step.bytes,
        "decode_weight_bytes": sum(op.weight_bytes for op in step.ops),
        "decode_kv_bytes": sum(op.kv_bytes for op in step.ops),
        "bandwidth_gbs": None, "bandwidth_source": None, "bandwidth_device": None,
        "decode_floor_ms": None, "mbu": None,
    }
    if gpu is None:
        return fields
    fields["bandwidth_gbs"] = gpu.mem_bw_gbs
    fields["bandwidth_source"] = gpu.source
    fields["bandwidth_device"] = gpu.name
    try:  # each operation at its own roof: a CPU's int8 block kernels are slower than its DRAM
        fields["decode_floor_ms"] = step.floor_seconds(gpu) * 1e3
    except KeyError:  # no FLOP rates (a CPU given only --cpu-bandwidth-gbs): the bandwidth floor
        fields["decode_floor_ms"] = step.bytes / gpu.mem_bw * 1e3
    if tpot_s:
        fields["mbu"] = step.mbu(tpot_s, gpu)
    return fields


def prefill_floor_s(engine, batch_size: int, input_len: int, gpu) -> Optional[float]:
    """The batch's prefill at the device's roofs, chunk by chunk as the scheduler cuts it
    (see the module docstring); None without FLOP rates."""
    import torch
    from rooflm.perf.results import compute_dtype_name
    from rooflm.perf.roofline import causal_pairs, step_cost

    info = engine.info
    config = info.model_config
    act = info.act_dtype_bytes or info.weight_dtype_bytes
    budget = info.max_num_batched_tokens
    done = [0] * batch_size  # prompt tokens computed per request
    total = 0.0
    try:
        while done[-1] < input_len:
            room, new_tokens, pairs, context, sampled = budget, 0, 0, 0, 0
            for i in range(batch_size):
                take = min(input_len - done[i], room)
                if take <= 0:
                    continue
                pairs += causal_pairs(take, done[i], config.sliding_window)
                context += done[i] + take
                new_tokens += take
                room -= take
                done[i] += take
                sampled += done[i] == input_len
                if room == 0:
                    break
            step = step_cost(config, prefill_tokens=new_tokens, prefill_attention_pairs=pairs,
                             prefill_context_tokens=context, num_sampled_prefills=sampled,
                             weight_bytes=info.weight_dtype_bytes, kv_bytes=info.kv_dtype_bytes,
                             act_bytes=act, head_bytes=info.head_dtype_bytes or None,
                             compute_dtype=info.matmul_dtype or compute_dtype_name(getattr(torch, info.dtype)))
            total += step.floor_seconds(gpu)
    except KeyError:  # no FLOP rate for this device (a CPU given only its bandwidth)
        return None
    return total


def resolve_input_lens(values: list[str], max_model_len: int, output_len: int) -> list[int]:
    """--input-len: integers, or 'sweep' for 128, 256, ... up to what the context leaves."""
    longest = max_model_len - output_len
    if values == ["sweep"]:
        if longest < 1:
            raise ValueError(f"--input-len sweep: --output-len {output_len} leaves no room for a "
                             f"prompt in --max-model-len {max_model_len}")
        lengths = [n for n in (128 << i for i in range(20)) if n < longest] + [longest]
        return [n for n in lengths if n >= 1]
    lengths = []
    for v in values:
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"--input-len takes integers or 'sweep', got {v!r}") from None
        if n < 1:
            raise ValueError(f"--input-len must be >= 1, got {n}")
        if n > longest:
            raise ValueError(f"--input-len {n} + --output-len {output_len} is over --max-model-len "
                             f"{max_model_len}")
        lengths.append(n)
    return lengths


# ---------------------------------------------------------------- the command


def _check_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")


def _stats_ms(values_s: list[float]) -> Optional[dict]:
    if not values_s:
        return None
    ms = [v * 1e3 for v in values_s]
    return {"median": statistics.median(ms), "mean": statistics.fmean(ms), "min": min(ms), "max": max(ms)}


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "min": min(values), "max": max(values)}


def summarize(iterations: list[IterationResult]) -> dict:
    tpots = [it.tpot_s for it in iterations if it.tpot_s is not None]
    return {
        "ttft_ms": _stats_ms([it.ttft_s for it in iterations]),
        "tpot_ms": _stats_ms(tpots),
        "e2e_latency_ms": _stats_ms([it.e2e_s for it in iterations]),
        "output_tokens_per_s": _stats([it.output_tokens_per_s for it in iterations]),
    }


def run_latency(args: argparse.Namespace, out: TextIO = None) -> int:
    import torch
    from rooflm.perf.results import resolve_gpu, stamp, write_json, write_markdown
    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.sampling_params import SamplingParams

    out = out or sys.stdout
    _check_args(args)
    engine_options = engine_kwargs(args)
    engine = LLMEngine.from_kwargs(**engine_options)
    device = torch.device(engine.info.device)
    # Resolved before the run: measuring the GPU would disturb the timed iterations.
    gpu = resolve_gpu(device, args.gpu, args.cpu_bandwidth_gbs)
    # Stamped before the run: the commit is the code that was loaded, even if it moves meanwhile.
    stamp_fields = stamp(device)
    if args.batch_size > engine.info.max_num_seqs:
        print(f"warning: --batch-size {args.batch_size} is over --max-num-seqs "
              f"{engine.info.max_num_seqs}: the batch runs in waves", file=sys.stderr)

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(args.prompt_seed)
    lengths = resolve_input_lens(args.input_len, engine.info.max_model_len, args.output_len)
    points = [_measure_point(engine, rng, params, args, n, gpu) for n in lengths]

    result = {
        "benchmark": "latency",
        **stamp_fields,
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "dtype": engine.info.dtype,
        "batch_size": args.batch_size, "input_len": lengths[0] if len(lengths) == 1 else lengths,
        "output_len": args.output_len,
        "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
        "engine_options": engine_options,
        "startup_s": engine.info.startup_s,
    }
    if len(points) == 1:
        result.update(points[0])
        out.write(format_summary(result))
    else:
        result["sweep"] = points
        out.write(format_sweep(result))
    if args.output_json:
        write_json(args.output_json, result)
        out.write(f"result written to {args.output_json}\n")
    if args.output_md:
        rows = _markdown_rows(result) if len(points) == 1 else _sweep_markdown_rows(result)
        write_markdown(args.output_md, "rooflm bench latency", result, *rows)
        out.write(f"markdown written to {args.output_md}\n")
    return 0


def _measure_point(engine, rng: random.Random, params, args: argparse.Namespace, input_len: int,
                   gpu) -> dict:
    """Warm-up and measured iterations at one prompt length, with the floors beside them."""
    preemptions_before = engine.snapshot().num_preemptions
    iterations = _run_iterations(engine, rng, params, args, input_len, engine.info.model_config.vocab_size)
    preemptions = engine.snapshot().num_preemptions - preemptions_before
    summary = summarize(iterations)
    step = decode_step_cost(engine, args.batch_size, input_len, args.output_len)
    tpot_ms = summary["tpot_ms"]["median"] if summary["tpot_ms"] else None
    floor = prefill_floor_s(engine, args.batch_size, input_len, gpu) if gpu is not None else None
    return {
        "input_len": input_len,
        **summary,
        "ttft_floor_ms": floor * 1e3 if floor is not None else None,
        "output_tokens_per_iter": iterations[0].output_tokens,
        "expected_output_tokens_per_iter": args.batch_size * args.output_len,
        "num_preemptions": preemptions,
        **mbu_fields(step, tpot_ms / 1e3 if tpot_ms else None, gpu),
        "iterations": [_iteration_json(it) for it in iterations],
    }


def _run_iterations(engine, rng: random.Random, params, args: argparse.Namespace, input_len: int,
                    vocab: int) -> list[IterationResult]:
    from tqdm import tqdm

    total = args.num_iters_warmup + args.num_iters
    bar = tqdm(total=total, desc=f"{input_len} tokens: " + ("warm-up" if args.num_iters_warmup else "measure"),
               unit="iter", disable=args.disable_tqdm, file=sys.stderr)
    iterations = []
    for i in range(total):
        warmup = i < args.num_iters_warmup
        if i == args.num_iters_warmup:
            bar.set_description(f"{input_len} tokens: measure")
        # Fresh prompts every iteration: a repeated prompt would be served by the prefix cache.
        prompts = random_prompts(rng, args.batch_size, input_len, vocab)
        result = run_iteration(engine, prompts, params, tag=f"latency-{input_len}-{i}")
        if not warmup:
            iterations.append(result)
        bar.update(1)
    bar.close()
    expected = args.batch_size * args.output_len
    short = [it.output_tokens for it in iterations if it.output_tokens != expected]
    if short:
        print(f"warning: iterations generated {short} tokens, not {expected}", file=sys.stderr)
    return iterations


def _iteration_json(it: IterationResult) -> dict:
    fields = asdict(it)
    fields["output_tokens_per_s"] = it.output_tokens_per_s
    return fields


def _fmt_ms(stats: Optional[dict]) -> str:
    return "n/a" if stats is None else f"{stats['median']:.2f}"


def format_summary(result: dict) -> str:
    width = 50
    lines = [" Latency Benchmark Result ".center(width, "="),
             f"{'Model:':<36} {result['model']}",
             f"{'Device:':<36} {result['device_name']} ({result['dtype']})",
             f"{'Batch x input x output:':<36} {result['batch_size']} x {result['input_len']} x "
             f"{result['output_len']}",
             f"{'Iterations (warm-up):':<36} {result['num_iters']} ({result['num_iters_warmup']})",
             f"{'Median TTFT (ms):':<36} {_fmt_ms(result['ttft_ms'])}"
             + (f" (floor {result['ttft_floor_ms']:.2f})" if result.get("ttft_floor_ms") else ""),
             f"{'Median TPOT (ms):':<36} {_fmt_ms(result['tpot_ms'])}",
             f"{'Median end-to-end latency (ms):':<36} {_fmt_ms(result['e2e_latency_ms'])}",
             f"{'Median output tokens/s:':<36} {result['output_tokens_per_s']['median']:.1f}",
             f"{'Preemptions:':<36} {result['num_preemptions']}",
             " Decode roofline ".center(width, "-"),
             f"{'Bytes per decode step (MB):':<36} {result['decode_bytes_per_step'] / 1e6:.2f}"]
    if result["mbu"] is None:
        reason = "no bandwidth known" if result["bandwidth_gbs"] is None \
            else "no decode step (output-len 1)"
        lines.append(f"{'MBU:':<36} n/a ({reason})")
    else:
        lines.append(f"{'Peak bandwidth (GB/s):':<36} {result['bandwidth_gbs']:,.0f} "
                     f"[{result['bandwidth_source']}]")
        lines.append(f"{'Decode step floor (ms):':<36} {result['decode_floor_ms']:.3f}")
        lines.append(f"{'MBU:':<36} {100 * result['mbu']:.1f}%")
    lines.append("=" * width)
    return "\n".join(lines) + "\n"


def _markdown_rows(result: dict) -> tuple[list[str], list[list]]:
    headers = ["batch", "input", "output", "TTFT ms", "TPOT ms", "E2E ms", "output tok/s", "MBU"]
    tpot = result["tpot_ms"]["median"] if result["tpot_ms"] else None
    mbu = f"{100 * result['mbu']:.1f}%" if result["mbu"] is not None else None
    row = [result["batch_size"], result["input_len"], result["output_len"],
           result["ttft_ms"]["median"], tpot, result["e2e_latency_ms"]["median"],
           result["output_tokens_per_s"]["median"], mbu]
    return headers, [row]


def _ratio(measured: Optional[float], floor: Optional[float]) -> Optional[float]:
    return floor / measured if measured and floor else None


def format_sweep(result: dict) -> str:
    """TTFT and TPOT against context length, each beside its floor."""
    lines = [f"rooflm bench latency: {result['model']} on {result['device_name']} ({result['dtype']}), "
             f"batch {result['batch_size']}, {result['output_len']} output tokens, medians of "
             f"{result['num_iters']}",
             f"{'input':>8} {'TTFT ms':>10} {'floor':>9} {'of floor':>8} {'TPOT ms':>9} {'floor':>8} {'MBU':>6}"]
    for p in result["sweep"]:
        ttft, tpot = p["ttft_ms"]["median"], p["tpot_ms"]["median"] if p["tpot_ms"] else None
        share = _ratio(ttft, p["ttft_floor_ms"])
        cells = [f"{p['input_len']:>8}", f"{ttft:>10.2f}",
                 f"{p['ttft_floor_ms']:>9.2f}" if p["ttft_floor_ms"] else f"{'n/a':>9}",
                 f"{100 * share:>7.0f}%" if share else f"{'n/a':>8}",
                 f"{tpot:>9.3f}" if tpot else f"{'n/a':>9}",
                 f"{p['decode_floor_ms']:>8.3f}" if p["decode_floor_ms"] else f"{'n/a':>8}",
                 f"{100 * p['mbu']:>5.0f}%" if p["mbu"] is not None else f"{'n/a':>6}"]
        lines.append(" ".join(cells))
    lines.append("floors: prefill chunk by chunk and one decode step at the device's roofs "
                 "('of floor': how close the measured TTFT comes to it)")
    return "\n".join(lines) + "\n"


def _sweep_markdown_rows(result: dict) -> tuple[list[str], list[list]]:
    headers = ["input", "TTFT ms", "TTFT floor ms", "TPOT ms", "decode floor ms", "MBU"]
    rows = []
    for p in result["sweep"]:
        tpot = p["tpot_ms"]["median"] if p["tpot_ms"] else None
        mbu = f"{100 * p['mbu']:.1f}%" if p["mbu"] is not None else None
        rows.append([p["input_len"], p["ttft_ms"]["median"], p["ttft_floor_ms"], tpot, p["decode_floor_ms"], mbu])
    return headers, rows
