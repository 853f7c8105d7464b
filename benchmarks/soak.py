"""Soak test (not CI): mixed valid and hostile traffic at a steady rate for N minutes.

Reports what should all be zero after a long run: failed valid requests, hostile requests
answered with a 5xx or not in OpenAI's error shape (or not answered), host RSS growth of the
server's processes, device memory growth, KV blocks still held and requests still running
once the traffic stops. Every 10 s it samples host RSS, device memory, the server's open file
descriptors, KV blocks in use and Triton cache entries; growth is judged over the last
--growth-window-s (5 minutes; the second half of a shorter run). Writes soak.json and soak.md
under --out and ends with one verdict line (exit status 0 when it passes).

    # the CPU, 30 s, the default model (a smoke run of the whole harness)
    CPU=1 OUT=/tmp/soak-cpu bash benchmarks/soak.sh

    # against a server it starts (the GPU command: benchmarks/soak.sh, docs/serving.md)
    python benchmarks/soak.py --out benchmarks/results/soak --minutes 10 --rate 8 \\
        --serve-args "--model benchmarks/models/llama-3-8b-dummy --load-format dummy --max-model-len 4096"
    # against a running one
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234 --minutes 10

Valid traffic (issue 51's mix): completions and chat, half streamed, a fifth of the streams
abandoned mid-way (their requests must be aborted and their blocks freed), and among them
n=2 requests, structured outputs (a JSON schema), tool calls (tool_choice "required") and
long prompts. Hostile traffic: the
cases of tests/server/hostile_corpus.py (their model field set to the served model; the
API-key cases left out), which must each be answered, in OpenAI's error shape when an
error. Needs httpx (the GPU machines have it); no server stack when --base-url is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.server import hostile_corpus  # noqa: E402 - the corpus is data shared with the tests

WORDS = ("the model runs at the roofline when every byte it moves is needed and every flop "
         "counts toward the answer while the scheduler keeps the batch full").split()
SAMPLE_EVERY_S = 10.0
GROWTH_LIMIT = 0.01  # host RSS and device memory may grow this much over the window

PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer"}},
                 "required": ["name", "age"]}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}


# ---- the server's processes and memory ----------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_rss(server_pid: Optional[int]) -> Optional[int]:
    """RSS of the server and its direct children (the engine core), in bytes."""
    if server_pid is None:
        return None
    return sum(_rss_bytes(pid) for pid in [server_pid, *_children(server_pid)])


def device_memory(server_pid: Optional[int]) -> Optional[int]:
    """Device memory used by the server's processes (nvidia-smi), else by the whole device."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    pids = {server_pid, *_children(server_pid)} if server_pid else None
    total = 0
    for line in out.strip().splitlines():
        pid, used = (part.strip() for part in line.split(","))
        if pids is None or int(pid) in pids:
            total += int(used) << 20
    return total


def open_fds(server_pid: Optional[int]) -> Optional[int]:
    """Open file descriptors of the server and its direct children (a leaked socket shows)."""
    if server_pid is None:
        return None
    total = 0
    for pid in [server_pid, *_children(server_pid)]:
        try:
            total += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
    return total


def triton_cache_entries() -> Optional[int]:
    """Compiled kernels in Triton's cache: a kernel compiled again and again shows as growth."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return sum(1 for _ in root.iterdir())
    except OSError:
        return None


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled-by-reason gauges of /metrics: name -> value."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if "finished_reason" in name_labels or name.endswith(("_bucket", "_sum", "_count")):
            continue
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def scrape(client: httpx.Client) -> dict[str, float]:
    return parse_metrics(client.get("/metrics").text)


def kv_state(client: httpx.Client) -> dict[str, float]:
    return kv_of(scrape(client))


def kv_of(m: dict[str, float]) -> dict[str, float]:
    return {"running": m.get("vllm:num_requests_running", -1),
            "waiting": m.get("vllm:num_requests_waiting", -1),
            "kv_blocks_in_use": m.get("rooflm:kv_num_blocks", 0) - m.get("rooflm:kv_free_blocks", 0),
            "tokens_in_flight": m.get("rooflm:tokens_in_flight", -1)}


# ---- traffic --------------------------------------------------------------------------------------


def hostile_cases(model: str) -> list:
    auth_names = {case.name for case in hostile_corpus.AUTH_CASES}
    cases = []
    for case in hostile_corpus.ALL_CASES:
        if case.name in auth_names:
            continue
        body = case.body
        if isinstance(body, dict) and body.get("model") == hostile_corpus.MODEL:
            body = {**body, "model": model}
        cases.append(replace(case, body=body))
    return cases


class Traffic:
    def __init__(self, client: httpx.AsyncClient, model: str, rng: random.Random,
                 max_tokens: int, hostile_fraction: float, api_key: Optional[str],
                 prompt_words: int, long_prompt_words: int):
        self.client = client
        self.model = model
        self.rng = rng
        self.max_tokens = max_tokens
        self.prompt_words = prompt_words
        self.long_prompt_words = long_prompt_words
        self.hostile_fraction = hostile_fraction
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.hostile = hostile_cases(model)
        self.outcomes: Counter = Counter()
        self.failures: list[str] = []
        self.latencies: list[float] = []

    def _fail(self, what: str) -> None:
        self.outcomes["failed"] += 1
        if len(self.failures) < 50:
            self.failures.append(what[:400])

    async def one(self) -> None:
        if self.rng.random() < self.hostile_fraction:
            await self._hostile(self.rng.choice(self.hostile))
        else:
            await self._valid()

    async def _hostile(self, case) -> None:
        headers = {"Content-Type": "application/json", **self.auth}
        if case.headers is not None:
            headers = {**case.headers, **self.auth} if "Authorization" not in case.headers else case.headers
        content = case.raw if case.raw is not None else (
            json.dumps(case.body).encode() if case.body is not None else None)
        try:
            response = await self.client.request(case.method, case.path, content=content,
                                                 headers=headers)
        except httpx.HTTPError as exc:
            self._fail(f"hostile {case.name}: {type(exc).__name__}: {exc}")
            return
        status = response.status_code
        self.outcomes[f"hostile {status // 100}xx"] += 1
        if status >= 500:
            self._fail(f"hostile {case.name}: {status} {response.text[:200]}")
        elif status >= 400 and case.method != "HEAD":
            try:
                error = response.json()["error"]
                assert {"message", "type", "param", "code"} <= set(error)
            except (ValueError, KeyError, AssertionError, TypeError):
                self._fail(f"hostile {case.name}: {status} not OpenAI's error shape: "
                           f"{response.text[:200]}")

    def _valid_body(self) -> tuple[str, str, dict]:
        """(kind, path, body): plain 60%, n=2 10%, structured 10%, tools 10%, long prompt 10%."""
        kind = self.rng.choices(["plain", "n2", "structured", "tools", "long"],
                                [60, 10, 10, 10, 10])[0]
        count = self.rng.randint(self.long_prompt_words // 2, self.long_prompt_words) \
            if kind == "long" else self.rng.randint(1, self.prompt_words)
        words = " ".join(self.rng.choice(WORDS) for _ in range(count))
        body = {"model": self.model, "max_tokens": self.rng.randint(8, self.max_tokens),
                "temperature": self.rng.choice([0.0, 0.7, 1.0]), "ignore_eos": True,
                "stream": self.rng.random() < 0.5}
        if kind == "n2":
            body.update(n=2, temperature=0.8)
        if kind == "structured":
            body.pop("ignore_eos")  # the grammar ends the object
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
        if kind == "tools":
            body.pop("ignore_eos")
            body.update(tools=[WEATHER_TOOL], tool_choice="required")
        chat = kind == "tools" or self.rng.random() < 0.5
        if not chat:
            return kind, "/v1/completions", {**body, "prompt": words}
        return kind, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}

    async def _valid(self) -> None:
        kind, path, body = self._valid_body()
        self.outcomes[f"valid sent: {kind}"] += 1
        started = time.monotonic()
        abandon_after = self.rng.randint(1, 8) if body["stream"] and self.rng.random() < 0.2 else None
        try:
            async with self.client.stream("POST", path, json=body, headers=self.auth) as response:
                if response.status_code == 429:
                    self.outcomes["valid 429 (busy)"] += 1
                    await response.aread()
                    return
                if response.status_code != 200:
                    await response.aread()
                    self._fail(f"valid {path}: {response.status_code} {response.text[:200]}")
                    return
                chunks = 0
                text = []
                async for line in response.aiter_lines():
                    text.append(line)
                    if line.startswith("data:"):
                        chunks += 1
                        if abandon_after is not None and chunks >= abandon_after:
                            self.outcomes["valid abandoned mid-stream"] += 1
                            return
        except httpx.HTTPError as exc:
            self._fail(f"valid {path}: {type(exc).__name__}: {exc}")
            return
        joined = "\n".join(text)
        if body["stream"] and (not joined.rstrip().endswith("data: [DONE]") or '"error"' in joined):
            self._fail(f"valid {path} stream: {joined[-200:]}")
            return
        if not body["stream"]:
            try:
                choices = json.loads(joined)["choices"]
            except (ValueError, KeyError, TypeError):
                self._fail(f"valid {path} ({kind}): not a completion: {joined[:200]}")
                return
            if len(choices) != body.get("n", 1):
                self._fail(f"valid {path} ({kind}): {len(choices)} choices for n={body.get('n', 1)}")
                return
        self.outcomes["valid ok"] += 1
        self.latencies.append(time.monotonic() - started)


async def sample_forever(client: httpx.AsyncClient, server_pid: Optional[int], samples: list,
                         started: float) -> None:
    """Every SAMPLE_EVERY_S: the server's resources and the engine's KV blocks in use."""
    while True:
        samples.append(await take_sample(client, server_pid, time.monotonic() - started))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def take_sample(client: httpx.AsyncClient, server_pid: Optional[int], t: float) -> dict:
    try:
        kv = kv_of(parse_metrics((await client.get("/metrics")).text))["kv_blocks_in_use"]
    except httpx.HTTPError:
        kv = None
    device = await asyncio.to_thread(device_memory, server_pid)
    return {"t": round(t, 1), "rss": host_rss(server_pid), "device": device,
            "fds": open_fds(server_pid), "kv_blocks_in_use": kv,
            "triton_cache_entries": triton_cache_entries()}


async def run_traffic(base_url: str, model: str, args, samples: list, server_pid: Optional[int]):
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.max_connections)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout,
                                 limits=limits) as client:
        traffic = Traffic(client, model, rng, args.max_tokens, args.hostile_fraction, args.api_key,
                          args.prompt_words, args.long_prompt_words)
        started = time.monotonic()
        deadline = started + args.minutes * 60
        sampler = asyncio.ensure_future(sample_forever(client, server_pid, samples, started))
        tasks: set[asyncio.Task] = set()
        interval = 1.0 / args.rate
        next_send = time.monotonic()
        while time.monotonic() < deadline:
            task = asyncio.ensure_future(traffic.one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_send += interval
            await asyncio.sleep(max(0.0, next_send - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=args.request_timeout + 30)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        return traffic


# ---- the server, when we start it ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(serve_args: str, out: Path, api_key: Optional[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "rooflm", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-interval", "60", *serve_args.split()]
    if api_key:
        command += ["--api-key", api_key]
    log = open(out / "server.log", "wb")
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {out / 'server.log'}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("the server was not ready within 900 s")


def wait_idle(client: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = kv_state(client)
        if (state["running"] == 0 and state["waiting"] == 0 and state["kv_blocks_in_use"] == 0
                and state["tokens_in_flight"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def _mb(value: Optional[int]) -> Optional[float]:
    return None if value is None else round(value / 2**20, 1)


def growth_window(samples: list, window_s: float) -> list:
    """The samples of the last window_s seconds (the second half of a run shorter than twice
    that): after caches filled, what still grows is a leak."""
    if not samples:
        return []
    end = samples[-1]["t"]
    window = min(window_s, end / 2)
    return [s for s in samples if s["t"] >= end - window]


def relative_growth(window: list, key: str) -> Optional[float]:
    values = [s[key] for s in window if s.get(key) is not None]
    if len(values) < 2 or values[0] <= 0:
        return None
    return (values[-1] - values[0]) / values[0]


def verdict(result: dict) -> tuple[bool, str]:
    """One line: what the soak must show, and whether it did."""
    g = result["growth_last_window"]
    hostile_5xx = result["requests"].get("hostile 5xx", 0)
    # Growth over a short window is caches filling, not a leak: judged only over at least half
    # the window asked for (a 30-s smoke run reports it, unjudged).
    judged = result["growth_window_s"] >= 0.5 * result["args"]["growth_window_s"]
    checks = {
        "failures": result["failures"] == 0,
        "hostile_5xx": hostile_5xx == 0,
        "kv_blocks_end": result["kv_blocks_leaked"] == 0,
        "rss": not judged or g["rss"] is None or g["rss"] <= GROWTH_LIMIT,
        "device": not judged or g["device"] is None or g["device"] <= GROWTH_LIMIT,
        "health": result.get("health_after") == 200,
        "exit": result["server_exit_code"] in (None, 0),
    }
    pct = lambda v: "n/a" if v is None else f"{v:+.2%}"  # noqa: E731
    line = (f"verdict: {'PASS' if all(checks.values()) else 'FAIL'} "
            f"failures={result['failures']} hostile_5xx={hostile_5xx} "
            f"hostile_4xx={result['requests'].get('hostile 4xx', 0)} "
            f"kv_blocks_end={result['kv_blocks_leaked']:.0f} "
            f"over the last {result['growth_window_s']:.0f} s: rss={pct(g['rss'])} "
            f"device={pct(g['device'])} fds={g['fds_delta']} "
            f"triton_cache={g['triton_cache_delta']}{'' if judged else ' (growth not judged)'} "
            f"exit={result['server_exit_code']}"
            + ("" if all(checks.values()) else
               " (missed: " + ", ".join(k for k, ok in checks.items() if not ok) + ")"))
    return all(checks.values()), line


def summarise(args, samples, traffic, idle_after, exit_code, model) -> dict:
    warm = [s for s in samples if s["t"] >= args.warmup_s] or samples
    window = growth_window(samples, args.growth_window_s)

    def delta(key):
        values = [s[key] for s in window if s.get(key) is not None]
        return values[-1] - values[0] if len(values) >= 2 else None

    def growth(key):
        values = [s[key] for s in warm if s[key] is not None]
        return _mb(values[-1] - values[0]) if len(values) >= 2 else None
    lat = sorted(traffic.latencies)
    pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None  # noqa: E731
    from rooflm.perf.results import git_commit
    commit = git_commit()  # ROOFLM_COMMIT where the tree is a copy (the device machine)
    gpu = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
        "gpu": gpu, "model": model, "args": vars(args),
        "requests": dict(traffic.outcomes), "failures": traffic.outcomes.get("failed", 0),
        "failure_examples": traffic.failures,
        "valid_latency_s": {"p50": pct(0.5), "p99": pct(0.99)},
        "host_rss_mb": {"first": _mb(warm[0]["rss"]) if warm else None,
                        "last": _mb(warm[-1]["rss"]) if warm else None, "growth": growth("rss")},
        "device_mb": {"first": _mb(warm[0]["device"]) if warm else None,
                      "last": _mb(warm[-1]["device"]) if warm else None, "growth": growth("device")},
        "after_traffic": idle_after, "kv_blocks_leaked": idle_after["kv_blocks_in_use"],
        "growth_window_s": (window[-1]["t"] - window[0]["t"]) if window else 0.0,
        "growth_last_window": {"rss": relative_growth(window, "rss"),
                               "device": relative_growth(window, "device"),
                               "fds_delta": delta("fds"),
                               "triton_cache_delta": delta("triton_cache_entries")},
        "server_exit_code": exit_code, "samples": samples,
    }


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:+.2%}"


def write_markdown(result: dict, path: Path) -> None:
    a = result["args"]
    lines = [
        f"# Soak: {a['minutes']} min at {a['rate']} req/s, {a['hostile_fraction']:.0%} hostile",
        "", f"{result['date']}, commit {result['commit']}, GPU {result['gpu']}, model {result['model']}",
        "", "| what | value |", "| --- | --- |",
        f"| failures (goal 0) | {result['failures']} |",
        f"| KV blocks in use after the traffic (goal 0) | {result['kv_blocks_leaked']:.0f} |",
        f"| requests running / waiting after | {result['after_traffic']['running']:.0f} / "
        f"{result['after_traffic']['waiting']:.0f} |",
        f"| host RSS growth after warm-up, MB | {result['host_rss_mb']['growth']} "
        f"({result['host_rss_mb']['first']} -> {result['host_rss_mb']['last']}) |",
        f"| device memory growth after warm-up, MB | {result['device_mb']['growth']} "
        f"({result['device_mb']['first']} -> {result['device_mb']['last']}) |",
        f"| valid request latency p50 / p99, s | {result['valid_latency_s']['p50']} / "
        f"{result['valid_latency_s']['p99']} |",
        f"| growth over the last {result['growth_window_s']:.0f} s: host RSS / device memory "
        f"(goal <= 1%) | {_pct(result['growth_last_window']['rss'])} / "
        f"{_pct(result['growth_last_window']['device'])} |",
        f"| ... open file descriptors / Triton cache entries | "
        f"{result['growth_last_window']['fds_delta']} / "
        f"{result['growth_last_window']['triton_cache_delta']} |",
        f"| server exit code after SIGTERM | {result['server_exit_code']} |",
        "", "Requests by outcome: " + ", ".join(f"{k}: {v}" for k, v in
                                               sorted(result["requests"].items())),
    ]
    if result["failure_examples"]:
        lines += ["", "First failures:", ""] + [f"- `{f}`" for f in result["failure_examples"][:20]]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for soak.json and soak.md")
    parser.add_argument("--base-url", default=None, help="a running server (else one is started)")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="the running server's pid, for host RSS and device memory")
    parser.add_argument("--serve-args", default="", help="flags of the `rooflm serve` we start")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second, steady")
    parser.add_argument("--hostile-fraction", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="valid requests ask for 8 to this many tokens")
    parser.add_argument("--prompt-words", type=int, default=300,
                        help="valid prompts have 1 to this many words")
    parser.add_argument("--long-prompt-words", type=int, default=2000,
                        help="a tenth of valid prompts have half to this many words")
    parser.add_argument("--growth-window-s", type=float, default=300.0,
                        help="growth is judged over the last this many seconds (5 minutes)")
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--warmup-s", type=float, default=30.0,
                        help="memory growth is measured from the first sample after this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    proc = None
    base_url, server_pid = args.base_url, args.server_pid
    if base_url is None:
        proc, base_url = start_server(args.serve_args, out, args.api_key)
        server_pid = proc.pid
    try:
        return _soak(args, out, base_url, server_pid, proc)
    finally:
        if proc is not None and proc.poll() is None:  # interrupted: the server goes with us
            proc.kill()


async def _last_sample(base_url: str, server_pid: Optional[int], t: float) -> dict:
    """The sample once the traffic stopped and the engine went idle."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return await take_sample(client, server_pid, t)


def _soak(args, out: Path, base_url: str, server_pid: Optional[int],
          proc: Optional[subprocess.Popen]) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=base_url, timeout=30, headers=headers) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        samples: list = []
        soak_started = time.monotonic()
        traffic = asyncio.run(run_traffic(base_url, model, args, samples, server_pid))
        idle_after = wait_idle(client)
        samples.append(asyncio.run(_last_sample(base_url, server_pid,
                                                time.monotonic() - soak_started)))
        healthy = client.get("/health").status_code
    exit_code = None
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = "killed after 60 s"
    result = summarise(args, samples, traffic, idle_after, exit_code, model)
    result["health_after"] = healthy
    clean, line = verdict(result)
    result["verdict"] = line
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out / "soak.md")
    print((out / "soak.md").read_text())
    print(line)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
