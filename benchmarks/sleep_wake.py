"""Sleep mode through `rooflm serve --enable-sleep-mode`: device memory freed by POST /sleep, and
the time from POST /wake_up to the first streamed token of a request sent right after it.
Issue 54's target 3: wake to first token <= 2 s from level 1 (Llama-3-8B shape on an H200).

Per level (1: weights moved to host memory; 2: weights dropped, loaded again at wake-up), a
few cycles of: warm request -> POST /sleep?level=L (timed) -> GPU memory read (nvidia-smi) and a
request that must get 503 -> POST /wake_up (t0) -> a streamed completion sent as soon as the
wake-up answers -> its first token (t1). wake to first token = t1 - t0; the wake-up call alone
and the request's TTFT are reported beside it, and the engine's own phases of the wake-up
(POST /wake_up's JSON: weights copied back or loaded, KV pool mapped and zeroed, CUDA graphs
kept or captured again), so one run tells where the time goes.

Prints a table with the target and writes JSON (--out).

    # the issue's run (H200, Llama-3-8B shape, dummy weights; a directory with tokenizer files,
    # from benchmarks/make_dummy_model_dir.py, so the first token arrives as text)
    python benchmarks/sleep_wake.py --model benchmarks/models/llama-3-8b-dummy --out sw.json
    # smoke test on the CPU (numbers mean nothing; no GPU memory to read)
    python benchmarks/sleep_wake.py --model /tmp/smollm2-dummy --device cpu --cycles 1 --output-len 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from overload_priority import Server, check_model_dir  # noqa: E402
from rooflm.bench.stream_client import SampleRequest, send_request  # noqa: E402

TARGET_WAKE_S = 2.0  # level 1, wake-up call to first token


def gpu_memory_used_mib() -> Optional[float]:
    """The GPU's used memory (all processes: the engine core's is nearly all of it), or None
    without nvidia-smi."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20, check=True).stdout
        return float(text.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def post(url: str, timeout: float = 600.0) -> tuple[int, dict]:
    """(status, the JSON body or {})."""
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else {}
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def stream_one(server: Server, args, seed: int, origin: Optional[float] = None):
    """One streamed completion of token ids; its RequestOutput: ttft from its own send, start
    (the send) from `origin` (perf_counter; default: just before the send)."""
    import aiohttp

    prompt = [(seed * 7919 + i * 104729) % (args.vocab_size - 100) + 100 for i in range(args.input_len)]
    req = SampleRequest(prompt, len(prompt), args.output_len)
    body = {"model": server.model, "prompt": prompt, "max_tokens": args.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
            start = time.perf_counter() if origin is None else origin
            return await send_request(client, server.url + "/v1/completions", body, req, start, False)
    return asyncio.run(run())


def cycle(server: Server, args, level: int, index: int) -> dict:
    warm = stream_one(server, args, seed=10 * index + level)
    if not warm.success:
        raise RuntimeError(f"the request before sleep failed: {warm.error}")
    awake_mib = gpu_memory_used_mib()
    t0 = time.perf_counter()
    status, _ = post(f"{server.url}/sleep?level={level}")
    sleep_s = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"POST /sleep?level={level} answered {status}")
    asleep_mib = gpu_memory_used_mib()
    refused = stream_one(server, args, seed=999)
    t0 = time.perf_counter()
    status, body = post(f"{server.url}/wake_up")
    woke = time.perf_counter()
    if status != 200:
        raise RuntimeError(f"POST /wake_up answered {status}")
    first = stream_one(server, args, seed=10 * index + level + 5, origin=t0)
    if not first.success or first.ttft is None:
        raise RuntimeError(f"the request after wake_up failed: {first.error or 'no first token time'}")
    return {
        "level": level, "sleep_s": sleep_s, "wake_up_call_s": woke - t0, "ttft_after_wake_s": first.ttft,
        # first.start: from the wake-up call to the request's send (the call, then the client's
        # session setup); ttft: from the send to the first token.
        "wake_to_first_token_s": first.start + first.ttft,
        "gpu_mib_awake": awake_mib, "gpu_mib_asleep": asleep_mib,
        "gpu_mib_freed": None if awake_mib is None or asleep_mib is None else awake_mib - asleep_mib,
        "asleep_request_503": refused.error.startswith("HTTP 503") if not refused.success else False,
        "asleep_request_error": refused.error[:200],
        # The engine's own account of the wake-up (LLMEngine.wake_up): seconds per phase, and
        # whether the CUDA graphs were kept or captured again.
        "wake_phases": body.get("phases"),
    }


def phases_text(phases: Optional[dict]) -> str:
    if not phases:
        return "n/a"
    return (f"weights {phases['weights_s']:.2f} ({phases['weights']}), kv {phases['kv_s']:.2f}, "
            f"graphs {phases['graphs_s']:.2f} ({phases['graphs']})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="preset name or model directory")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids are drawn below this "
                   "(default: the model directory's config.json)")
    p.add_argument("--levels", default="1,2")
    p.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level")
    p.add_argument("--server-args", default="", help="more `rooflm serve` flags, one string")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    check_model_dir(args)
    # `timeout` sends SIGTERM: exit through the servers' context managers, which stop them (an
    # orphaned server would hold the GPU through the next benchmark).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.server_args = args.server_args.split() + ["--enable-sleep-mode"]
    args.max_queued_requests = 64
    args.log_dir = args.log_dir or (os.path.dirname(os.path.abspath(args.out)) if args.out else "/tmp")
    os.makedirs(args.log_dir, exist_ok=True)
    levels = [int(x) for x in args.levels.split(",")]
    cycles = []
    with Server(args, "sleep", []) as server:
        for level in levels:
            for i in range(args.cycles):
                c = cycle(server, args, level, i)
                cycles.append(c)
                print(f"level {level} #{i}: sleep {c['sleep_s']:.2f} s, wake_up {c['wake_up_call_s']:.2f} s, "
                      f"first token {c['wake_to_first_token_s']:.2f} s after the wake-up call, "
                      f"freed {c['gpu_mib_freed']} MiB, asleep request 503: {c['asleep_request_503']}; "
                      f"wake_up phases: {phases_text(c['wake_phases'])}", flush=True)
    lines = [f"Sleep mode: {args.model}, {args.cycles} cycles per level; a {args.input_len}-token request "
             f"right after POST /wake_up", "",
             "| level | GPU MiB awake | GPU MiB asleep | freed MiB | sleep s | wake_up s | wake_up phases s "
             "(last cycle) | wake to first token s (median / max) | target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    summary = {}
    for level in levels:
        cs = [c for c in cycles if c["level"] == level]
        w = [c["wake_to_first_token_s"] for c in cs]
        s = summary[level] = {
            "wake_to_first_token_median_s": statistics.median(w), "wake_to_first_token_max_s": max(w),
            "wake_up_call_median_s": statistics.median(c["wake_up_call_s"] for c in cs),
            "sleep_median_s": statistics.median(c["sleep_s"] for c in cs),
            "gpu_mib_awake": cs[0]["gpu_mib_awake"], "gpu_mib_asleep": cs[0]["gpu_mib_asleep"],
            "gpu_mib_freed": cs[0]["gpu_mib_freed"], "all_asleep_requests_503": all(c["asleep_request_503"] for c in cs),
            "wake_phases_last": cs[-1]["wake_phases"]}
        mib = lambda v: "n/a" if v is None else f"{v:,.0f}"
        target = ""
        if level == 1:
            target = f"<= {TARGET_WAKE_S:g} s: {'met' if s['wake_to_first_token_max_s'] <= TARGET_WAKE_S else 'MISSED'}"
        lines.append(f"| {level} | {mib(s['gpu_mib_awake'])} | {mib(s['gpu_mib_asleep'])} | {mib(s['gpu_mib_freed'])} | "
                     f"{s['sleep_median_s']:.2f} | {s['wake_up_call_median_s']:.2f} | {phases_text(s['wake_phases_last'])} | "
                     f"{s['wake_to_first_token_median_s']:.2f} / {s['wake_to_first_token_max_s']:.2f} | {target} |")
    report = "\n".join(lines)
    print("\n" + report, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cycles": cycles, "summary": summary, "table": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
