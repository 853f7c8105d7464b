"""The server's host CPU per streamed token: the API process and the engine core, apart.

Usage: python benchmarks/serve_cpu_cost.py [--concurrency 16] [--requests 64] [--max-tokens 64]
           [--no-engine-process] [-- <rooflm serve flags>]

Starts `rooflm serve` on 127.0.0.1 with the given flags, warms it up, then sends
--requests streaming completions (--concurrency at a time, ignore_eos, so each
streams exactly --max-tokens tokens) and reads each server process's CPU time
(user + system, /proc/<pid>/stat: Linux only) before and after. Prints the
microseconds of CPU per streamed token of the API process and of the engine
core (with --no-engine-process there is one process, and it does both), and
the idle CPU of the API process over the same wall time, measured first, so
heartbeats and timers are not billed to tokens.

Prompts are 16 token ids below 256, so a tiny random model with a real
tokenizer (`--model <tiny HF dir> --tokenizer <SmolLM2 .gguf>`) makes the
engine cheap and the API process's share visible on a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.server.server_utils import engine_core_pid, free_port  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


async def one_stream(client: httpx.AsyncClient, model: str, index: int, max_tokens: int) -> int:
    # Token ids below 256 fit any vocabulary (a tiny test model's too).
    prompt = [(index * 7 + i) % 256 for i in range(16)]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        # Split on LF only, as SSE does: JSON leaves U+2028 and NEL unescaped, and
        # httpx's aiter_lines() would break a chunk there.
        body_bytes = b"".join([chunk async for chunk in response.aiter_bytes()])
    for line in body_bytes.split(b"\n"):
        if line.startswith(b"data: {"):
            usage = json.loads(line[len(b"data: "):]).get("usage")
            if usage:
                return usage["completion_tokens"]
    return 0


async def load(url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> int:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 1)) as client:
        async def bounded(index: int) -> int:
            async with limit:
                return await one_stream(client, model, index, max_tokens)
        return sum(await asyncio.gather(*(bounded(i) for i in range(requests))))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit("the server did not get ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-engine-process", action="store_true")
    parser.add_argument("serve_args", nargs="*", help="flags for rooflm serve (after --)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "rooflm", "serve", "--port", str(port), "--log-interval", "0",
               *(["--no-engine-process"] if args.no_engine_process else []), *args.serve_args]
    proc = subprocess.Popen(command)
    try:
        wait_ready(url, proc)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        core = engine_core_pid(proc.pid)
        asyncio.run(load(url, model, args.concurrency, args.concurrency, 4))  # warm-up
        idle_start, idle_cpu = time.monotonic(), cpu_seconds(proc.pid)
        time.sleep(3.0)
        idle_rate = (cpu_seconds(proc.pid) - idle_cpu) / (time.monotonic() - idle_start)

        pids = {"api": proc.pid, **({"core": core} if core else {})}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        tokens = asyncio.run(load(url, model, args.requests, args.concurrency, args.max_tokens))
        wall = time.monotonic() - started
        spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    finally:
        proc.terminate()
        proc.wait(60)

    mode = "engine thread (one process)" if core is None else "engine core process"
    print(f"{mode}: {tokens} tokens streamed in {wall:.1f} s ({tokens / wall:.0f} tok/s), "
          f"{args.requests} requests, concurrency {args.concurrency}")
    for name, seconds in spent.items():
        # The API process's idle cost (timers, the core's heartbeats) is not the tokens'.
        busy = seconds - idle_rate * wall if name == "api" else seconds
        print(f"  {name:4s} process: {seconds:.2f} s CPU ({seconds / wall:.0%} of a core), "
              f"{1e6 * busy / tokens:.0f} us per token")
    print(f"  api process idle: {1e3 * idle_rate:.1f} ms of CPU per second")


if __name__ == "__main__":
    main()
