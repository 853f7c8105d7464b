"""`rooflm bench serve --client-processes N`: the benchmark client spread over N processes.

One Python process parses every SSE chunk of a busy server, and can fall behind it: on the H100
at 80 req/s (~11,600 streamed tokens a second) `bench serve`'s single process was 50% busy on
average. With N processes the client's own load stays out of what it times (at 80 req/s on
that H100, four processes were each at most 18% busy; the gap between their TTFT and the
server's stayed, since the API process's streaming made it: benchmarks/results/
simulate-fidelity-h100-20261126/). The arrival schedule is drawn once, as the single
process draws it, and request i goes to process i mod N, which sends it at its own offset
from a start time all processes share; their outputs are merged back in request order.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import random
import time
from typing import Optional, Sequence


_WORKER_ARGS = ("temperature", "ignore_eos", "request_timeout", "api_key")


def arrival_offsets(count: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, seconds from the start: the gaps bench serve's arrival
    process draws (gamma, shape `burstiness`, mean 1 / rate; all at 0 for an infinite rate)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(count):
        offsets.append(t)
        if not math.isinf(request_rate) and i < count - 1:
            t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return offsets


async def _send_all(base_url: str, endpoint: str, model: str, jobs, args, start_wall: float):
    import aiohttp

    from rooflm.bench.stream_client import _is_chat, _payload, send_request

    url = base_url.rstrip("/") + "/" + endpoint.lstrip("/")
    chat = _is_chat(endpoint)
    # Times relative to the shared start, on this process's perf_counter.
    bench_start = time.perf_counter() - (time.time() - start_wall)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as client:
        async def one(index, req, offset):
            delay = bench_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return index, await send_request(client, url, _payload(req, model, endpoint, args), req,
                                             bench_start, chat)

        return await asyncio.gather(*(one(i, req, off) for i, req, off in jobs))


def _worker(rank: int, base_url, endpoint, model, jobs, args, ready, start, results) -> None:
    ready.put(rank)
    start_wall = start.get()
    cpu0 = time.process_time()
    try:
        outputs = asyncio.run(_send_all(base_url, endpoint, model, jobs, args, start_wall))
        results.put((rank, outputs, time.process_time() - cpu0, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, [], time.process_time() - cpu0, f"{type(exc).__name__}: {exc}"))


def run_pool(base_url: str, endpoint: str, model: str, requests: Sequence, args, processes: int,
             offsets: Optional[Sequence[float]] = None):
    """Send `requests` from `processes` client processes; returns (outputs in request order,
    duration from the shared start to the last response, CPU seconds of the busiest process).
    offsets: each request's send time from the start (default: drawn as bench serve draws them)."""
    if offsets is None:
        offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    jobs = [[] for _ in range(processes)]
    for i, (req, off) in enumerate(zip(requests, offsets)):
        jobs[i % processes].append((i, req, off))
    ctx = mp.get_context("spawn")  # the parent may hold threads (tqdm, a server in tests)
    ready, results = ctx.Queue(), ctx.Queue()
    starts = [ctx.Queue() for _ in range(processes)]
    # What the workers read (the request body's options, the session's timeout and key): picklable.
    light_args = argparse.Namespace(**{k: getattr(args, k) for k in _WORKER_ARGS})
    workers = [ctx.Process(target=_worker, args=(r, base_url, endpoint, model, jobs[r], light_args,
                                                  ready, starts[r], results), daemon=True)
               for r in range(processes)]
    for w in workers:
        w.start()
    try:
        for _ in range(processes):
            ready.get(timeout=120)
        start_wall = time.time() + 0.2
        for q in starts:
            q.put(start_wall)
        outputs, cpu, errors = [None] * len(requests), [], []
        for _ in range(processes):
            _, part, cpu_s, error = results.get(timeout=args.request_timeout + 600)
            cpu.append(cpu_s)
            if error:
                errors.append(error)
            for index, out in part:
                outputs[index] = out
        duration = time.time() - start_wall
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
    if errors:
        raise RuntimeError("a benchmark client process failed: " + "; ".join(errors))
    return outputs, duration, max(cpu)
