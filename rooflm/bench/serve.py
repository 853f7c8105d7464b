"""`rooflm bench serve`: load-test any OpenAI-compatible endpoint and report serving latency.

The benchmark builds a list of requests (random lengths, a ShareGPT file, or a
shared-prefix workload), releases them on a schedule (a Poisson process at
--request-rate, a gamma process when --burstiness is not 1, or all at once)
under an optional --max-concurrency cap, and streams every response. From the
arrival time of each streamed chunk it measures, per request:

  TTFT  time to first token: request sent -> first content chunk
  ITL   inter-token latency: the gap between consecutive content chunks
  TPOT  time per output token after the first: (E2EL - TTFT) / (output tokens - 1)
  E2EL  end-to-end latency: request sent -> stream finished

and prints the block users of serving benchmarks expect (vLLM's
benchmark_serving layout), with goodput: the rate of requests that met every
SLO given with --goodput. A failed request (HTTP error, error event in the
stream, connection refused, timeout) is counted and its message reported; it
never stops the run.

Output tokens are counted from the usage chunk the server sends when asked
with stream_options.include_usage, else one per content chunk. A chunk counts
as a token arrival when it carries text, token ids, or is an explicit
empty-text token chunk (a model without a tokenizer): a stream of token ids
is still timed. A figure that cannot be measured (a server that sent every
token in its last chunk has no TTFT, TPOT or ITL) is reported as "n/a" with
the reason, never as 0.

--request-rate takes several rates (`4 8 16 inf`): one benchmark per rate, one
result per rate, and with --plot a chart of TTFT/TPOT percentiles and goodput
against the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict
from datetime import datetime
from typing import Optional, Sequence, TextIO

from rooflm.bench.stream_client import SampleRequest, _is_chat, _payload, send_request
from rooflm.perf.serving_metrics import (RequestOutput, compute_metrics, format_report, format_sweep, parse_goodput,
                                        rate_label, tpot_s)

# Common English words, each about one token for BPE tokenizers, for text
# prompts of a chosen length when the endpoint cannot take token ids (chat).
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have had not but "
    "are were which one all their there been has when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come "
    "since against go came right used take three house river light water small place found"
).split()


# SampleRequest, RequestOutput and send_request: rooflm/bench/stream_client.py (the client pool
# imports them without this module).

# ---------------------------------------------------------------- datasets


def _sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's random dataset)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def _random_prompt(rng: random.Random, num_tokens: int, as_text: bool, vocab_size: int):
    if as_text:
        return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
    # Ids from 100 up skip the special and byte tokens at the start of most vocabularies.
    return [rng.randrange(100, vocab_size) for _ in range(num_tokens)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, as_text: bool = False, vocab_size: int = 32000) -> list[SampleRequest]:
    """Prompts of random tokens (or words) with lengths spread by `range_ratio` around the means."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        n_in = _sample_len(rng, input_len, range_ratio)
        n_out = _sample_len(rng, output_len, range_ratio)
        requests.append(SampleRequest(_random_prompt(rng, n_in, as_text, vocab_size), n_in, n_out))
    return requests


def prefix_requests(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int,
                    num_prefixes: int = 1, seed: int = 0, as_text: bool = False,
                    vocab_size: int = 32000) -> list[SampleRequest]:
    """A prefix-caching workload: `num_prefixes` shared prefixes, each request one of them plus
    its own random suffix; the order is shuffled so hits interleave with misses."""
    if num_prefixes < 1:
        raise ValueError("--num-prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [_random_prompt(rng, prefix_len, as_text, vocab_size) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        prefix = prefixes[i % num_prefixes]
        suffix = _random_prompt(rng, suffix_len, as_text, vocab_size)
        prompt = (prefix + " " + suffix) if as_text else (prefix + suffix)
        requests.append(SampleRequest(prompt, prefix_len + suffix_len, output_len))
    rng.shuffle(requests)
    return requests


def _count_tokens(text: str, tokenizer) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text))
    # Without a tokenizer: ~4 characters per token, the usual rule of thumb for English.
    return max(1, round(len(text) / 4))


def sharegpt_requests(path: str, num_prompts: int, seed: int = 0, output_len: Optional[int] = None,
                      tokenizer=None) -> list[SampleRequest]:
    """Conversations from a ShareGPT-format JSON file: the first turn is the prompt, the second
    sets max_tokens. Like vLLM, pairs that are too short (< 4 tokens) or too long (prompt > 1024,
    prompt + output > 2048) are skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    conversations = [d["conversations"] for d in data
                     if isinstance(d, dict) and len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(conversations)
    requests = []
    for conv in conversations:
        if len(requests) == num_prompts:
            break
        prompt, completion = conv[0]["value"], conv[1]["value"]
        prompt_len = _count_tokens(prompt, tokenizer)
        out_len = output_len if output_len is not None else _count_tokens(completion, tokenizer)
        if prompt_len < 4 or out_len < 4:
            continue
        if prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        requests.append(SampleRequest(prompt, prompt_len, out_len))
    if not requests:
        raise ValueError(f"{path}: no usable ShareGPT conversations")
    return requests


# ---------------------------------------------------------------- the client


async def _arrivals(requests: Sequence[SampleRequest], request_rate: float, burstiness: float,
                    seed: int):
    """Yield requests at the configured arrival process.

    Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean
    1 / request_rate: burstiness 1 is exponential gaps, a Poisson process;
    below 1 is burstier, above 1 more even. An infinite rate sends all at once.
    """
    rng = random.Random(seed)
    for i, req in enumerate(requests):
        yield req
        if math.isinf(request_rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))


async def run_benchmark(base_url: str, endpoint: str, model: str, requests: Sequence[SampleRequest],
                        args: argparse.Namespace) -> tuple[list[RequestOutput], float]:
    """Send every request on schedule; return their outputs (in request order) and the duration."""
    import aiohttp
    from tqdm import tqdm

    url = base_url.rstrip("/") + "/" + endpoint.lstrip("/")
    chat = _is_chat(endpoint)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    # aiohttp, as vLLM's benchmark uses: with httpx the client itself took ~6 ms of CPU per
    # request, so 1000 requests "at once" reached an H100 server over ~7 s while it idled.
    # No connection cap inside the client: the arrival process and --max-concurrency alone
    # decide how many requests are in flight, or queueing in the pool would inflate TTFT.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    progress = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests", unit="req")

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as client:
        bench_start = time.perf_counter()

        async def one(req: SampleRequest) -> RequestOutput:
            payload = _payload(req, model, endpoint, args)
            if semaphore is None:
                result = await send_request(client, url, payload, req, bench_start, chat)
            else:
                async with semaphore:
                    result = await send_request(client, url, payload, req, bench_start, chat)
            progress.update(1)
            return result

        tasks = []
        async for req in _arrivals(requests, args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
    progress.close()
    return list(outputs), duration


def register(subparsers) -> None:
    """Add the `serve` subcommand to the subparsers of `rooflm bench`."""
    p = subparsers.add_parser(
        "serve", help="load-test an OpenAI-compatible endpoint: TTFT, TPOT, ITL, throughput",
        description="Stream requests to an OpenAI-compatible server at a chosen arrival rate and "
                    "concurrency and report TTFT, TPOT, ITL, end-to-end latency and throughput.")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--dataset-name", choices=("random", "sharegpt", "prefix"), default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random; prefix: "
                   "the unique suffix after the shared prefix)")
    p.add_argument("--output-len", type=int, default=None, help="max_tokens per request "
                   "(default 128; sharegpt: default the conversation's own reply length)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix: shared prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=1, help="prefix: distinct shared prefixes")
    p.add_argument("--prompt-format", choices=("auto", "tokens", "words"), default="auto",
                   help="random/prefix prompts as token ids or words (auto: token ids for "
                        "completions, words for chat)")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="token ids of random prompts are drawn below this")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer (HF directory) to count ShareGPT tokens; default: "
                        "~4 characters per token, corrected by the server's usage chunk")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], metavar="RATE",
                   help="requests per second, Poisson arrivals (default inf: all at once); "
                        "several rates (e.g. 4 8 16 inf) run one benchmark each")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--client-processes", type=int, default=1, metavar="N",
                   help="spread the client over N processes (request i from process i mod N, on "
                        "one arrival schedule), so that parsing thousands of chunks a second does "
                        "not delay the reads it times; the report's 'Client CPU busy' says when "
                        "one process is not enough")
    p.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 (also e2el:MS)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly max_tokens (vLLM/rooflm extension)")
    p.add_argument("--api-key", default=None,
                   help="sent as a Bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--result-file", default=None, help="JSON path (implies --save-result); "
                   "with several rates, each gets -rate<R> before the extension")
    p.add_argument("--result-dir", default=".", help="where --save-result writes by default")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="one rate: latency distributions and throughput over time; several "
                        "rates: TTFT/TPOT P50 and P99 and goodput against the rate")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_serve)


def build_requests(args: argparse.Namespace) -> list[SampleRequest]:
    chat = _is_chat(args.endpoint)
    as_text = chat if args.prompt_format == "auto" else args.prompt_format == "words"
    if chat and not as_text:
        raise ValueError("chat endpoints take text: use --prompt-format words")
    output_len = args.output_len if args.output_len is not None else 128
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.input_len, output_len, args.range_ratio,
                               args.seed, as_text, args.vocab_size)
    if args.dataset_name == "prefix":
        return prefix_requests(args.num_prompts, args.prefix_len, args.input_len, output_len,
                               args.num_prefixes, args.seed, as_text, args.vocab_size)
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, args.output_len,
                             tokenizer)


def _result_path(args: argparse.Namespace, rate: float, several: bool) -> str:
    """Where one rate's result goes: --result-file (suffixed per rate when there are several),
    else a dated name in --result-dir."""
    if args.result_file:
        if not several:
            return args.result_file
        stem, ext = os.path.splitext(args.result_file)
        return f"{stem}-rate{rate_label(rate)}{ext or '.json'}"
    return os.path.join(args.result_dir, f"serve-{args.model.replace('/', '_')}-rate"
                                         f"{rate_label(rate)}-"
                                         f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")


def _run_one_rate(args: argparse.Namespace, requests: list[SampleRequest],
                  goodput_slos: dict[str, float], several: bool, out: TextIO) -> dict:
    """One benchmark at args.request_rate: print the report, write the result; the metrics."""
    rate = "inf (all at once)" if math.isinf(args.request_rate) else \
        f"{args.request_rate:g} req/s, burstiness {args.burstiness:g}" + \
        (" (Poisson)" if args.burstiness == 1.0 else " (gamma)")
    out.write(f"{len(requests)} requests from {args.dataset_name} to "
              f"{args.base_url.rstrip('/')}{args.endpoint}; arrivals {rate}; max concurrency "
              f"{args.max_concurrency or 'unlimited'}\n")
    out.flush()
    from rooflm.bench.server_side import run_ttft_ms, scrape_ttft_buckets

    before = scrape_ttft_buckets(args.base_url)
    processes = getattr(args, "client_processes", 1) or 1
    if processes > 1:
        from rooflm.bench.client_pool import run_pool

        outputs, duration, client_cpu_s = run_pool(args.base_url, args.endpoint, args.model, requests,
                                                   args, processes)
    else:
        cpu0 = time.process_time()
        outputs, duration = asyncio.run(run_benchmark(args.base_url, args.endpoint, args.model,
                                                      requests, args))
        client_cpu_s = time.process_time() - cpu0
    metrics = compute_metrics(outputs, duration, goodput_slos)
    # The client's own CPU, and the server's TTFT: a busy client delays reading its chunks.
    metrics["client_cpu_s"] = client_cpu_s  # the busiest client process's
    metrics["client_cpu_busy"] = client_cpu_s / max(duration, 1e-9)
    metrics["client_processes"] = processes
    metrics["server_ttft_ms"] = run_ttft_ms(before, scrape_ttft_buckets(args.base_url))
    out.write(format_report(metrics, args))

    if args.save_result or args.result_file:
        path = _result_path(args, args.request_rate, several)
        result = {
            "date": datetime.now().isoformat(timespec="seconds"),
            "base_url": args.base_url, "endpoint": args.endpoint, "model": args.model,
            "dataset_name": args.dataset_name, "num_prompts": len(requests),
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "goodput_slos_ms": goodput_slos or None,
            **{k: v for k, v in metrics.items()},
            "requests": [
                {k: v for k, v in asdict(o).items() if k not in ("generated_text", "chunk_times")}
                for o in outputs],
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        out.write(f"result written to {path}\n")

    if args.plot and not several:
        from rooflm.perf.plot import plot_serving

        ok = [o for o in outputs if o.success]
        tpots = [t * 1e3 for t in (tpot_s(o) for o in ok) if t is not None]
        token_times = []
        for o in ok:
            # One point per output token: a chunk carrying k tokens counts k times.
            per_chunk = round(o.output_tokens / len(o.chunk_times)) if o.chunk_times else 0
            for t in o.chunk_times:
                token_times.extend([t] * per_chunk)
        plot_serving([o.ttft * 1e3 for o in ok if o.ttft is not None], tpots,
                     [g * 1e3 for o in ok for g in o.itl],
                     [o.latency * 1e3 for o in ok], token_times, duration, args.plot,
                     title=f"{args.model} at {args.base_url}: {metrics['completed']} ok, "
                           f"{metrics['failed']} failed")
        out.write(f"plots written to {args.plot}\n")
    return metrics


def run_serve(args: argparse.Namespace, out: TextIO = None) -> int:
    out = out or sys.stdout
    rates = list(args.request_rate) if isinstance(args.request_rate, (list, tuple)) \
        else [args.request_rate]
    try:
        goodput_slos = parse_goodput(args.goodput)
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if any(not r > 0 for r in rates) or args.burstiness <= 0:
            raise ValueError("--request-rate and --burstiness must be > 0")
        if args.client_processes < 1:
            raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
        if args.client_processes > 1 and args.max_concurrency:
            raise ValueError("--max-concurrency caps one process's requests in flight: it does not "
                             "combine with --client-processes > 1")
        requests = build_requests(args)
    except (ValueError, OSError) as exc:
        print(f"rooflm bench serve: error: {exc}", file=sys.stderr)
        return 2

    several = len(rates) > 1
    sweep = []
    for i, rate in enumerate(rates):
        # Fresh prompts for each rate (seed + i), drawn from the same distribution: the same
        # prompts again would be served from the server's prefix cache and flatter TTFT.
        rate_args = argparse.Namespace(**{**vars(args), "request_rate": rate, "seed": args.seed + i})
        if i:
            requests = build_requests(rate_args)
        sweep.append(_run_one_rate(rate_args, requests, goodput_slos, several, out))
    if several:
        out.write(" Sweep over request rates ".center(50, "=") + "\n")
        out.write(format_sweep(rates, sweep))
        if args.plot:
            from rooflm.perf.plot import plot_rate_sweep

            plot_rate_sweep(rates, sweep, args.plot,
                            title=f"{args.model} at {args.base_url}: {len(requests)} requests "
                                  f"per rate")
            out.write(f"plot written to {args.plot}\n")
    return 0 if all(m["completed"] > 0 for m in sweep) else 1
