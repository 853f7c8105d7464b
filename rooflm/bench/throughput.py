"""`rooflm bench throughput`: how many tokens per second the offline engine sustains.

All --num-prompts requests are submitted at once (random token ids by default,
or the conversations of a ShareGPT file), with ignore_eos so that each one
generates exactly its output length, and the engine is stepped until every
request is done. Reported: requests/s, output tokens/s, total (prompt +
output) tokens/s, elapsed time and preemptions. Prompts are token ids before
the clock starts, so tokenization is not timed.

Random prompts have lengths uniform in [len * (1 - r), len * (1 + r)] for
--range-ratio r, for both the prompt and the output, drawn with a fixed seed
(the same dataset as `rooflm bench serve --dataset-name random`).

The analytic bound (on CUDA, or with --gpu NAME as a what-if on the CPU) is
the best output tokens/s the GPU's peak rates allow for this workload; on CUDA
the rates are measured on the card before the run (a 1 GiB device copy and an
8192^3 bf16 matmul), unless --gpu names a datasheet:

  prefill is compute-bound: every prompt token goes through every weight once,
    prefill_s = FLOPs of all prompts (step_cost, causal attention included)
                / peak matmul FLOP/s of the compute dtype
  decode is bandwidth-bound: a decode step reads every weight and the K/V of
    every running sequence at its context. As many sequences run as the KV
    pool holds at the mean context, capped by max_num_seqs and the number of
    requests:
      C = min(max_num_seqs, num_prompts, num_blocks * block_size / (P + Q/2))
    with P and Q the mean prompt and output lengths (a sequence is on average
    half way through its output). One decode step costs
      step_s = max(bytes(C sequences at context P + Q/2) / bandwidth,
                   FLOPs(same) / peak FLOP/s)
    (the FLOP term only matters when C is past the ridge point), and each
    request's first output token comes out of its prefill, so
      decode_s = (total output tokens - num_prompts) / C * step_s
  bound on output tokens/s = total output tokens / (prefill_s + decode_s)

A second, tighter bound runs the same schedule with every operation (each GEMM, attention,
norms, ...) at its own roof, one after another, as the engine's kernels run: the first bound
lets attention's K/V reads hide under the GEMMs' FLOPs, which only kernels running side by side
could do.

It is a floor on time, so a ceiling on throughput, under the roofline model's
assumptions: prefill's weight reads and decode's arithmetic hide under each
other's roof, and steps that mix prefill chunks with decodes (which share one
weight read) are counted as if they were apart, which makes the bound slightly
loose. The measured output tokens/s over the bound is the fraction achieved.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Optional, TextIO

# torch is imported inside the functions that run an engine: the CLI builds this parser for
# `rooflm --help` and every other command, which must not pay for importing torch.
from rooflm.engine_args import add_engine_args, engine_kwargs


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def register(subparsers) -> None:
    """Add the `throughput` subcommand to the subparsers of `rooflm bench`."""

    p = subparsers.add_parser(
        "throughput", help="requests/s and tokens/s of many requests at once, next to the bound",
        description="Submit every request at once to the offline engine, step it until all are "
                    "done, and report requests/s, output and total tokens/s, and (on CUDA) the "
                    "analytic throughput bound of the GPU.")
    g = p.add_argument_group("benchmark options")
    g.add_argument("--num-prompts", type=int, default=100, help="requests (default 100)")
    g.add_argument("--input-len", type=int, default=256,
                   help="mean prompt tokens of random prompts (default 256)")
    g.add_argument("--output-len", type=int, default=None,
                   help="mean output tokens, EOS ignored (default 128; with --dataset: the "
                        "conversation's own reply length)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random lengths uniform in [len*(1-r), len*(1+r)] (default 0)")
    g.add_argument("--dataset", default=None,
                   help="ShareGPT JSON file (a list of {\"conversations\": [{\"from\", \"value\"}, "
                        "...]}); needs a tokenizer. Default: random token ids")
    g.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompts (default 0)")
    g.add_argument("--num-warmup-requests", type=int, default=1,
                   help="requests run before the clock starts, to absorb one-time costs such as "
                        "kernel compilation (default 1)")
    g.add_argument("--gpu", default=None,
                   help="peak rates for the bound: 'measure' (the default on CUDA: this card's "
                        "copy bandwidth and bf16 matmul rate, measured before the run) or a GPU "
                        "table key (its datasheet; on the CPU a what-if bound)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engines side by side, each on its own GPU or TP group, each running "
                        "every N-th request; tokens summed over the run's wall time (rooflm/dp/)")
    g.add_argument("--output-json", default=None, help="write the result to this JSON file")
    g.add_argument("--output-md", default=None, help="write a markdown summary to this file")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--breakdown", action="store_true",
                   help="print (and save) where the time went: steps by kind (decode in a CUDA graph, "
                        "decode eager, mixed, prefill), their floor, and the host's time by phase")
    add_engine_args(p)
    p.set_defaults(func=run_throughput)


# ---------------------------------------------------------------- the requests


def random_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    from rooflm.bench.serve import random_requests as serve_random_requests

    output_len = args.output_len if args.output_len is not None else 128
    samples = serve_random_requests(args.num_prompts, args.input_len, output_len, args.range_ratio,
                                    seed=args.prompt_seed, as_text=False, vocab_size=vocab_size)
    return [BenchRequest(s.prompt, s.output_len) for s in samples]


def sharegpt_requests(args: argparse.Namespace, engine) -> list[BenchRequest]:
    """ShareGPT conversations, tokenized by the engine's tokenizer; too long ones are skipped."""
    from rooflm.bench.serve import sharegpt_requests as serve_sharegpt_requests

    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("--dataset needs a tokenizer: this model has none (give --tokenizer)")
    samples = serve_sharegpt_requests(args.dataset, args.num_prompts, seed=args.prompt_seed,
                                      output_len=args.output_len, tokenizer=tokenizer)
    requests = []
    for s in samples:
        ids = tokenizer.encode(s.prompt)
        if len(ids) + s.output_len <= engine.info.max_model_len:
            requests.append(BenchRequest(ids, s.output_len))
    if not requests:
        raise ValueError(f"{args.dataset}: no conversation fits the context length of "
                         f"{engine.info.max_model_len}")
    return requests


def warmup_requests(requests: list[BenchRequest], count: int) -> list[BenchRequest]:
    """Short copies of the first requests: a prefill of the same length and a few decode steps.

    The prompt's ids are reversed so that the prefix cache cannot serve the
    timed request later.
    """
    return [BenchRequest(list(reversed(r.prompt_token_ids)), min(r.output_len, 4))
            for r in requests[:count]]


# ---------------------------------------------------------------- the run


@dataclass
class RunResult:
    elapsed_s: float
    num_completed: int
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    steps: int
    preemptions: int
    spec: Optional[dict] = None  # speculative decoding over the run (spec_summary)


def spec_summary(before, after) -> Optional[dict]:
    """Speculative decoding between two snapshots' SpecSnapshots; None without it."""
    if after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "draft_s": after.draft_s - before.draft_s, "verify_s": after.verify_s - before.verify_s}


def run_requests(engine, requests: list[BenchRequest], tag: str, disable_tqdm: bool) -> RunResult:
    """Submit every request at once, step until all are done, and time it."""
    import torch
    from tqdm import tqdm

    from rooflm.perf.results import synchronize
    from rooflm.sampling_params import SamplingParams

    device = torch.device(engine.info.device)
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    wanted = set(ids)
    before = engine.snapshot()
    bar = tqdm(total=len(requests), desc=tag, unit="req", disable=disable_tqdm, file=sys.stderr)
    synchronize(device)
    start = time.perf_counter()
    for request_id, req in zip(ids, requests):
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True,
                                output_kind="final")
        engine.add_request(request_id, req.prompt_token_ids, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                final[out.request_id] = out
                bar.update(1)
    synchronize(device)
    elapsed = time.perf_counter() - start
    bar.close()
    after = engine.snapshot()
    return RunResult(
        elapsed_s=elapsed,
        num_completed=len(final),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in final.values()),
        cached_prompt_tokens=sum(o.num_cached_tokens for o in final.values()),
        steps=after.steps - before.steps,
        preemptions=after.num_preemptions - before.num_preemptions,
        spec=spec_summary(before.spec, after.spec))


# ---------------------------------------------------------------- the bound


def throughput_bound(engine, gpu, requests: list[BenchRequest]) -> dict:
    """The analytic ceiling on output tokens/s of this workload (see the module docstring)."""
    import torch
    from rooflm.perf.results import compute_dtype_name
    from rooflm.perf.roofline import causal_pairs, step_cost

    info = engine.info
    config = info.model_config
    act = info.act_dtype_bytes or info.weight_dtype_bytes
    compute_dtype = compute_dtype_name(getattr(torch, info.dtype))
    # K/V at the pool's bytes per element (FP8 caches: 1 byte plus the scales' share).
    common = dict(weight_bytes=info.weight_dtype_bytes, kv_bytes=info.kv_dtype_bytes,
                  act_bytes=act, compute_dtype=compute_dtype, head_bytes=info.head_dtype_bytes or None,
                  tp=info.tensor_parallel_size)  # per rank: each GPU's share, plus the all-reduces
    peak_flops = gpu.peak_flops(compute_dtype)
    num = len(requests)
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    total_prompt = sum(prompt_lens)
    total_output = sum(r.output_len for r in requests)

    pairs = sum(causal_pairs(p, 0, config.sliding_window) for p in prompt_lens)
    prefill = step_cost(config, prefill_tokens=total_prompt, prefill_attention_pairs=pairs,
                        prefill_context_tokens=total_prompt, num_sampled_prefills=num, **common)
    prefill_s = prefill.flops / peak_flops

    mean_prompt = total_prompt / num
    mean_output = total_output / num
    mean_context = mean_prompt + mean_output / 2
    kv_pool_tokens = info.kv_capacity_tokens
    concurrency = min(info.max_num_seqs, num,
                      max(1, math.floor(kv_pool_tokens / mean_context)))
    attended = min(mean_context, config.sliding_window) if config.sliding_window else mean_context
    decode = step_cost(config, num_decode_seqs=concurrency,
                       decode_context_tokens=round(concurrency * attended), **common)
    step_memory_s = decode.bytes / gpu.mem_bw
    step_compute_s = decode.flops / peak_flops
    decode_step_s = max(step_memory_s, step_compute_s)
    decode_tokens = total_output - num
    decode_s = decode_tokens / concurrency * decode_step_s
    # The same schedule with every operation at its own roof, one after another (kernels run in
    # sequence: attention's K/V reads do not hide under the GEMMs' FLOPs).
    serial_s = prefill.floor_seconds(gpu) + decode_tokens / concurrency * decode.floor_seconds(gpu)
    return {
        "gpu": gpu.name, "gpu_source": gpu.source,
        "peak_tflops": peak_flops / 1e12, "bandwidth_gbs": gpu.mem_bw_gbs,
        "compute_dtype": compute_dtype,
        "prefill_flops": prefill.flops, "prefill_floor_s": prefill_s,
        "decode_concurrency": concurrency, "decode_mean_context": mean_context,
        "decode_bytes_per_step": decode.bytes, "decode_step_floor_ms": decode_step_s * 1e3,
        "decode_step_bound": "memory" if step_memory_s >= step_compute_s else "compute",
        "decode_steps": decode_tokens / concurrency, "decode_floor_s": decode_s,
        "floor_s": prefill_s + decode_s,
        "output_tokens_per_s": total_output / (prefill_s + decode_s),
        "serial_floor_s": serial_s,
        "serial_output_tokens_per_s": total_output / serial_s,
    }


# ---------------------------------------------------------------- the command


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {args.input_len}")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and args.breakdown:
        raise ValueError("--breakdown reads one engine's steps; run it without --data-parallel-size")
    if args.num_warmup_requests < 0:
        raise ValueError(f"--num-warmup-requests must be >= 0, got {args.num_warmup_requests}")


def _want_bound(device, gpu_name: Optional[str]) -> bool:
    # On the CPU a bound is only a what-if for a GPU named on the command line.
    return device.type == "cuda" or gpu_name is not None


def prepare_run(args: argparse.Namespace, engine) -> tuple:
    """What a run needs once its engine is built: the device, the GPU peaks for the bound (None:
    no bound), the stamp and the requests."""
    import torch
    from rooflm.perf.results import resolve_gpu, stamp

    device = torch.device(engine.info.device)
    gpu = None
    if _want_bound(device, args.gpu):
        # Resolved before the run: measuring the GPU would disturb the timed run.
        # Measured by default on CUDA: the bound is what this card does, not its datasheet.
        gpu = resolve_gpu(device, args.gpu or ("measure" if device.type == "cuda" else None),
                          allow_other_gpu=True)
    # Stamped before the run: the commit is the code that was loaded, even if it moves meanwhile.
    stamp_fields = stamp(device)
    if args.dataset:
        requests = sharegpt_requests(args, engine)
    else:
        requests = random_requests(args, engine.info.model_config.vocab_size)
    return device, gpu, stamp_fields, requests


def run_throughput(args: argparse.Namespace, out: TextIO = None) -> int:
    from rooflm.bench.breakdown import StepBreakdown
    from rooflm.perf.results import write_json, write_markdown
    from rooflm.perf.live import StepMeter
    from rooflm.engine.llm_engine import LLMEngine

    out = out or sys.stdout
    _check_args(args)
    if args.data_parallel_size > 1:
        raise ValueError("run_throughput runs one engine: --data-parallel-size > 1 goes through "
                         "rooflm.bench.commands.run_throughput_command")
    engine_options = engine_kwargs(args)
    engine = LLMEngine.from_kwargs(**engine_options)
    device, gpu, stamp_fields, requests = prepare_run(args, engine)
    if args.num_warmup_requests:
        run_requests(engine, warmup_requests(requests, args.num_warmup_requests), "warm-up",
                     disable_tqdm=True)
    breakdown = None
    if args.breakdown:
        breakdown = StepBreakdown(StepMeter.for_engine(engine.info, gpu))
        engine.add_observer(breakdown.observe)
    run = run_requests(engine, requests, "requests", args.disable_tqdm)
    expected_output = sum(r.output_len for r in requests)
    if run.output_tokens != expected_output:
        print(f"warning: generated {run.output_tokens} output tokens, asked for {expected_output}",
              file=sys.stderr)

    result = {
        "benchmark": "throughput",
        **stamp_fields,
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "dtype": engine.info.dtype,
        "dataset": args.dataset or "random",
        "num_prompts": len(requests), "input_len": args.input_len,
        "output_len": args.output_len, "range_ratio": args.range_ratio,
        "engine_options": engine_options,
        "startup_s": engine.info.startup_s,
        "kv_cache_blocks": engine.info.num_blocks,
        "block_size": engine.info.block_size,
        "elapsed_s": run.elapsed_s,
        "num_completed": run.num_completed,
        "total_prompt_tokens": run.prompt_tokens,
        "total_output_tokens": run.output_tokens,
        "expected_output_tokens": expected_output,
        "requests_per_s": run.num_completed / run.elapsed_s,
        "output_tokens_per_s": run.output_tokens / run.elapsed_s,
        "total_tokens_per_s": (run.prompt_tokens + run.output_tokens) / run.elapsed_s,
        "num_steps": run.steps,
        "num_preemptions": run.preemptions,
        "prefix_cache_hit_tokens": run.cached_prompt_tokens,
        "bound": None,
        "fraction_of_bound": None,
        "breakdown": breakdown.as_dict() if breakdown else None,
        "spec_decode": run.spec,
    }
    if gpu is not None:
        bound = throughput_bound(engine, gpu, requests)
        result["bound"] = bound
        result["fraction_of_bound"] = result["output_tokens_per_s"] / bound["output_tokens_per_s"]
    out.write(format_summary(result, device.type))
    if breakdown is not None:
        out.write(breakdown.format())
    if args.output_json:
        write_json(args.output_json, result)
        out.write(f"result written to {args.output_json}\n")
    if args.output_md:
        write_markdown(args.output_md, "rooflm bench throughput", result, *_markdown_rows(result))
        out.write(f"markdown written to {args.output_md}\n")
    return 0


def format_summary(result: dict, device_type: str) -> str:
    width = 50

    def row(label: str, value: str) -> str:
        return f"{label:<38} {value}"

    lines = [" Throughput Benchmark Result ".center(width, "="),
             row("Model:", result["model"]),
             row("Device:", f"{result['device_name']} ({result['dtype']})"),
             row("Dataset:", result["dataset"]),
             row("Requests completed:", f"{result['num_completed']} of {result['num_prompts']}"),
             row("Prompt / output tokens:",
                 f"{result['total_prompt_tokens']:,} / {result['total_output_tokens']:,}"),
             row("Elapsed (s):", f"{result['elapsed_s']:.2f}"),
             row("Request throughput (req/s):", f"{result['requests_per_s']:.2f}"),
             row("Output token throughput (tok/s):", f"{result['output_tokens_per_s']:,.1f}"),
             row("Total token throughput (tok/s):", f"{result['total_tokens_per_s']:,.1f}"),
             row("Engine steps:", str(result["num_steps"])),
             row("Preemptions:", str(result["num_preemptions"]))]
    if result.get("data_parallel_size", 1) > 1:
        lines.insert(4, row("Data-parallel replicas (tokens summed):",
                            str(result["data_parallel_size"])))
    spec = result.get("spec_decode")
    if spec is not None:
        lines += [" Speculative decoding ".center(width, "-"),
                  row("Drafts / draft tokens / accepted:",
                      f"{spec['drafts']:,} / {spec['draft_tokens']:,} / {spec['accepted_tokens']:,}"),
                  row("Acceptance rate:", f"{spec['acceptance_rate']:.3f}"),
                  row("Mean accepted length (tokens/step):", f"{spec['mean_accepted_length']:.2f}"),
                  row("Draft / verify time (s):", f"{spec['draft_s']:.2f} / {spec['verify_s']:.2f}")]
    bound = result["bound"]
    if bound is not None:
        what_if = "" if device_type == "cuda" else " (what-if: this run is on the CPU)"
        lines += [" Analytic bound ".center(width, "-"),
                  row("GPU:", f"{bound['gpu']}{what_if}"),
                  row("Prefill floor (s), compute-bound:", f"{bound['prefill_floor_s']:.4g}"),
                  row("Decode sequences at once:", str(bound["decode_concurrency"])),
                  row(f"Decode step floor (ms), {bound['decode_step_bound']}-bound:",
                      f"{bound['decode_step_floor_ms']:.4g}"),
                  row("Decode floor (s):", f"{bound['decode_floor_s']:.4g}"),
                  row("Bound on output tokens/s:", f"{bound['output_tokens_per_s']:,.1f}"),
                  row("Measured / bound:", f"{100 * result['fraction_of_bound']:.1f}%"),
                  row("Bound, operations in sequence:", f"{bound['serial_output_tokens_per_s']:,.1f}"),
                  row("Measured / that bound:",
                      f"{100 * result['output_tokens_per_s'] / bound['serial_output_tokens_per_s']:.1f}%")]
    lines.append("=" * width)
    return "\n".join(lines) + "\n"


def _markdown_rows(result: dict) -> tuple[list[str], list[list]]:
    headers = ["requests", "prompt tokens", "output tokens", "elapsed s", "req/s", "output tok/s",
               "total tok/s", "preemptions", "bound output tok/s", "of bound"]
    bound = result["bound"]
    row = [result["num_completed"], result["total_prompt_tokens"], result["total_output_tokens"],
           result["elapsed_s"], result["requests_per_s"], result["output_tokens_per_s"],
           result["total_tokens_per_s"], result["num_preemptions"],
           bound["output_tokens_per_s"] if bound else None,
           f"{100 * result['fraction_of_bound']:.1f}%" if bound else None]
    return headers, [row]
