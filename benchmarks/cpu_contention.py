"""The CPU server beside N CPU-bound competitors (issue 51's cliff): decode speed and a burst's time.

    python benchmarks/cpu_contention.py --competitors 2
    python benchmarks/cpu_contention.py --competitors 2 --contention off   # the cliff, for contrast

Three phases, each against a `rooflm serve` of the default model (SmolLM2-135M,
--device cpu) started for it:
  quiet       the server alone: batch-1 decode tokens/s (one greedy stream), and
              the output tokens/s of --streams concurrent greedy streams against one
              (the same requests, timed from the first sent to the last answered);
  contended   N competitors (each a process spinning on a core) start, then a
              server (its threads chosen under that load, engine/cpu_threads.py):
              batch-1 decode tokens/s, then 8 concurrent requests of ~32 prompt and
              16 output tokens, each one's completion time.
The issue's targets: contended decode >= 30% of quiet, all 8 done within 20 s;
quiet, 4 streams >= 1.5x the output tokens/s of one.
Prints one line per number and a verdict; --json writes them. Competitors are
children of this script, killed at its end (and they stop by themselves after
--competitor-limit-s). Benchmark numbers, not test assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_32 = ("The history of the city begins with a small settlement by the river, where "
             "traders met each season to exchange grain, salt and cloth before")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_competitors(count: int, limit_s: float) -> list[subprocess.Popen]:
    spin = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(30)


class Server:
    def __init__(self, extra_args: list[str], env: dict[str, str], log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        command = [sys.executable, "-m", "rooflm", "serve", "--host", "127.0.0.1", "--port",
                   str(self.port), "--device", "cpu", "--max-model-len", "512",
                   "--log-interval", "0", "--disable-log-requests", *extra_args]
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, **env},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


async def decode_tokens_per_s(url: str, model: str, tokens: int) -> float:
    """One greedy stream's decode rate: tokens after the first over the time they took."""
    body = {"model": model, "prompt": PROMPT_32, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    times = []
    async with httpx.AsyncClient(timeout=600) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:])["choices"]:
                        times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError("the stream produced fewer than 2 chunks")
    return (len(times) - 1) / (times[-1] - times[0])


async def burst_seconds(url: str, model: str, count: int, tokens: int) -> list[float]:
    """count concurrent requests; each one's time from the burst's start to its answer."""
    body = {"model": model, "prompt": PROMPT_32, "max_tokens": tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=count)) as client:
        started = time.perf_counter()

        async def one() -> float:
            response = await client.post(url + "/v1/completions", json=body)
            response.raise_for_status()
            return time.perf_counter() - started

        return sorted(await asyncio.gather(*(one() for _ in range(count))))


async def streams_tokens_per_s(url: str, model: str, streams: int, tokens: int) -> float:
    """Output tokens/s of `streams` concurrent greedy streams of `tokens` tokens each."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams)) as client:
        async def one(i: int) -> int:
            body = {"model": model, "prompt": f"{PROMPT_32} {i}", "max_tokens": tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}
            chunks = 0
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                        chunks += 1
            return chunks

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        return sum(counts) / (time.perf_counter() - started)


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def measure(server: Server, args, burst: bool) -> dict:
    server.wait_ready(args.ready_timeout_s)
    model = model_name(server.url)
    asyncio.run(decode_tokens_per_s(server.url, model, 8))  # warm: first-call costs
    result = {"decode_tok_s": asyncio.run(decode_tokens_per_s(server.url, model, args.decode_tokens))}
    if not burst and args.streams > 1:
        for streams in (1, args.streams):
            result[f"streams_{streams}_tok_s"] = asyncio.run(
                streams_tokens_per_s(server.url, model, streams, args.decode_tokens))
    if burst:
        result["burst_s"] = asyncio.run(burst_seconds(server.url, model, args.burst, args.burst_tokens))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--competitors", type=int, default=2)
    parser.add_argument("--contention", choices=("auto", "on", "off"), default="auto",
                        help="ROOFLM_CPU_CONTENTION of the contended server (off: the cliff)")
    parser.add_argument("--serve-args", default="", help="more `rooflm serve` flags")
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=4,
                        help="quiet phase: this many concurrent streams against one (1: skip)")
    parser.add_argument("--quiet-only", action="store_true", help="the quiet phase only")
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--burst-tokens", type=int, default=16)
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--competitor-limit-s", type=float, default=1800,
                        help="competitors stop by themselves after this long")
    parser.add_argument("--settle-s", type=float, default=20,
                        help="seconds the competitors run before the server starts (the load "
                             "average rises over about a minute)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/rooflm-cpu-contention"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = args.serve_args.split()
    env = {"PYTHONPATH": f"{REPO_ROOT}:{os.environ.get('PYTHONPATH', '')}"}

    quiet_server = Server(extra, env, args.out / "quiet.log")
    try:
        quiet = measure(quiet_server, args, burst=False)
    finally:
        quiet_server.stop()
    print(f"load average before the competitors: {os.getloadavg()[0]:.1f} "
          f"({len(os.sched_getaffinity(0))} cores)")
    print(f"quiet: batch-1 decode {quiet['decode_tok_s']:.1f} tok/s")
    if args.streams > 1:
        one, many = quiet["streams_1_tok_s"], quiet[f"streams_{args.streams}_tok_s"]
        print(f"quiet: {args.streams} concurrent streams {many:.1f} output tok/s, one stream {one:.1f}: "
              f"{many / one:.2f}x (target >= 1.5x)")
    if args.quiet_only:
        return 0

    competitors = start_competitors(args.competitors, args.competitor_limit_s)
    try:
        time.sleep(args.settle_s)
        contended_server = Server(extra, {**env, "ROOFLM_CPU_CONTENTION": args.contention},
                                  args.out / "contended.log")
        try:
            contended = measure(contended_server, args, burst=True)
        finally:
            contended_server.stop()
        load = os.getloadavg()[0]
    finally:
        stop_all(competitors)
    plan = [line for line in (args.out / "contended.log").read_text(errors="replace").splitlines()
            if "CPU threads" in line]
    ratio = contended["decode_tok_s"] / quiet["decode_tok_s"]
    burst = contended["burst_s"]
    print(f"contended ({args.competitors} competitors, load average {load:.1f}, "
          f"ROOFLM_CPU_CONTENTION={args.contention}): {plan[-1].strip() if plan else 'plan not logged'}")
    print(f"contended: batch-1 decode {contended['decode_tok_s']:.1f} tok/s = {ratio:.0%} of quiet "
          f"(target >= 30%)")
    print(f"contended: {args.burst} concurrent {args.burst_tokens}-token requests done in "
          f"{', '.join(f'{s:.1f}' for s in burst)} s; last {burst[-1]:.1f} s (target <= 20 s)")
    verdict = ratio >= 0.30 and burst[-1] <= 20.0
    print(f"verdict: {'PASS' if verdict else 'MISS'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"competitors": args.competitors,
                                         "contention": args.contention, "quiet": quiet,
                                         "contended": contended, "ratio": ratio,
                                         "load_average": load, "plan": plan,
                                         "pass": verdict}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
