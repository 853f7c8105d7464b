"""`rooflm bench serve` against a stub OpenAI-compatible SSE endpoint on 127.0.0.1.

The stub is a ThreadingHTTPServer in a daemon thread, started per test on a
free port and shut down after it. Its mode decides what every request gets:
  ok         a valid stream of max_tokens chunks, then a usage chunk and [DONE]
  error      alternately HTTP 500 and HTTP 429 with an OpenAI error body
  mixed      every third request an HTTP 500, the others a valid stream
  midstream  two tokens, then an error event inside the stream
  tokenless  one empty-text chunk per token (a model without a tokenizer), then finish_reason
  onechunk   every token's text in the closing chunk (nothing per token)
  u2028      tokens whose text holds U+2028 / U+2029 / NEL, sent unescaped
"""

import argparse
import io
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rooflm.bench import serve
from rooflm.perf import serving_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _StubHandler(BaseHTTPRequestHandler):
    # HTTP/1.0: the streamed body ends when the connection closes, no chunked encoding needed.
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def _send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _event(self, obj):
        # ensure_ascii=False: U+2028 and friends go on the wire raw, as many servers send them
        payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        self.wfile.write(f"data: {payload}\n\n".encode())
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        server = self.server
        with server.lock:
            index = server.count
            server.count += 1
            server.bodies.append(body)
        mode = server.mode
        if mode == "error" or (mode == "mixed" and index % 3 == 2):
            if mode == "error" and index % 2 == 1:
                self._send_json(429, {"error": {"message": "rate limit exceeded", "type": "rate_limit"}})
            else:
                self._send_json(500, {"error": {"message": "engine overloaded", "type": "server_error"}})
            return

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = "messages" in body
        num_tokens = body["max_tokens"]
        if chat:
            self._event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                        "content": ""}}]})
        for i in range(num_tokens if mode != "onechunk" else 0):
            if mode == "midstream" and i == 2:
                self._event({"error": {"message": "engine died", "code": 500}})
                return
            time.sleep(0.002)
            text = {"tokenless": "", "u2028": f"a\u2028b\u2029c\x85{i}"}.get(mode, f" tok{i}")
            delta = {"delta": {"content": text}} if chat else {"text": text}
            self._event({"id": "x", "object": "text_completion", "choices": [{"index": 0, **delta}]})
        time.sleep(0.002)
        final_text = "".join(f" tok{i}" for i in range(num_tokens)) if mode == "onechunk" else ""
        final = {"delta": {"content": final_text}} if chat else {"text": final_text}
        self._event({"id": "x", "choices": [{"index": 0, **final, "finish_reason": "length"}]})
        prompt = body.get("prompt") or body["messages"][0]["content"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self._event({"id": "x", "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
            "total_tokens": prompt_tokens + num_tokens}})
        self._event("[DONE]")


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    server.daemon_threads = True
    server.lock = threading.Lock()
    server.count = 0
    server.bodies = []
    server.mode = "ok"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _url(server):
    return f"http://127.0.0.1:{server.server_address[1]}"


def _run(argv):
    parser = argparse.ArgumentParser()
    bench = parser.add_subparsers().add_parser("bench").add_subparsers()
    serve.register(bench)
    args = parser.parse_args(["bench", "serve", "--disable-tqdm", "--request-timeout", "10"] + argv)
    out = io.StringIO()
    rc = args.func(args, out=out)
    return rc, out.getvalue()


def test_successful_streams_are_measured(stub, tmp_path):
    result = tmp_path / "result.json"
    png = tmp_path / "serve.png"
    rc, text = _run(["--base-url", _url(stub), "--model", "stub", "--num-prompts", "8",
                     "--input-len", "16", "--output-len", "6", "--goodput", "ttft:10000", "tpot:10000",
                     "--result-file", str(result), "--plot", str(png)])
    assert rc == 0
    assert "Successful requests:                     8" in text
    assert "Failed requests:                         0" in text
    assert "Total generated tokens:                  48" in text
    for needle in ("Benchmark duration (s):", "Request throughput (req/s):",
                   "Request goodput (req/s):", "Output token throughput (tok/s):",
                   "Mean TTFT (ms):", "Median TTFT (ms):", "P90 TTFT (ms):", "P99 TTFT (ms):",
                   "Mean TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):"):
        assert needle in text, needle
    saved = json.loads(result.read_text())
    assert saved["completed"] == 8 and saved["failed"] == 0
    assert saved["good_requests"] == 8
    assert saved["total_output_tokens"] == 48
    assert saved["ttft_ms"]["mean"] > 0 and saved["itl_ms"]["mean"] > 0
    assert all(len(r["itl"]) == 5 for r in saved["requests"])
    assert png.read_bytes()[:8] == PNG_MAGIC
    # Random prompts went out as token ids with the requested lengths and a usage request.
    body = stub.bodies[0]
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 16
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_errors_are_counted_and_reported_not_raised(stub):
    stub.mode = "error"
    rc, text = _run(["--base-url", _url(stub), "--model", "stub", "--num-prompts", "6",
                     "--input-len", "8", "--output-len", "4"])
    assert rc == 1  # nothing succeeded
    assert "Successful requests:                     0" in text
    assert "Failed requests:                         6" in text
    assert "3 x HTTP 500: engine overloaded" in text
    assert "3 x HTTP 429: rate limit exceeded" in text


def test_mixed_results_with_poisson_arrivals_and_a_concurrency_cap(stub):
    stub.mode = "mixed"
    rc, text = _run(["--base-url", _url(stub), "--model", "stub", "--num-prompts", "9",
                     "--input-len", "8", "--output-len", "4", "--request-rate", "200",
                     "--max-concurrency", "2", "--goodput", "ttft:0.001"])
    assert rc == 0
    assert "Successful requests:                     6" in text
    assert "Failed requests:                         3" in text
    assert "Maximum request concurrency:             2" in text
    assert "Request goodput (req/s):                 0.00" in text  # no one meets a 1 us TTFT
    assert "3 x HTTP 500: engine overloaded" in text


def test_error_inside_the_stream_and_chat_endpoint(stub):
    stub.mode = "midstream"
    rc, text = _run(["--base-url", _url(stub), "--endpoint", "/v1/chat/completions",
                     "--model", "stub", "--num-prompts", "3", "--input-len", "5", "--output-len", "5"])
    assert rc == 1
    assert "3 x error in stream: engine died" in text
    assert "messages" in stub.bodies[0]  # chat payload with a text prompt


def test_unreachable_server_is_a_failure_not_a_crash():
    import socket

    with socket.socket() as sock:  # a port nothing listens on once this block closes it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc, text = _run(["--base-url", f"http://127.0.0.1:{port}", "--model", "stub",
                     "--num-prompts", "2", "--input-len", "4", "--output-len", "2"])
    assert rc == 1
    assert "Failed requests:                         2" in text
    assert "ConnectorError" in text  # aiohttp.ClientConnectorError, named in the report


def test_datasets(tmp_path):
    reqs = serve.random_requests(200, input_len=100, output_len=50, range_ratio=0.5, seed=1)
    assert all(50 <= r.prompt_len <= 150 and 25 <= r.output_len <= 75 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10

    shared = serve.prefix_requests(6, prefix_len=10, suffix_len=5, output_len=3, num_prefixes=2, seed=0)
    prefixes = {tuple(r.prompt[:10]) for r in shared}
    assert len(prefixes) == 2 and all(r.prompt_len == 15 for r in shared)

    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "word " * 40},
                                      {"from": "gpt", "value": "reply " * 30}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}]},  # one turn: skipped
        {"id": "c", "conversations": [{"from": "human", "value": "x"},
                                      {"from": "gpt", "value": "too short"}]},  # < 4 tokens
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    got = serve.sharegpt_requests(str(path), num_prompts=10)
    assert len(got) == 1 and got[0].prompt.startswith("word")
    assert serve.sharegpt_requests(str(path), 10, output_len=7)[0].output_len == 7


def test_poisson_and_gamma_arrivals_have_the_configured_mean_rate():
    # The arrival process draws gamma(shape=burstiness, scale=1/(rate*burstiness)) gaps.
    for burstiness in (1.0, 0.5):
        rng = random.Random(0)
        gaps = [rng.gammavariate(burstiness, 1 / (4.0 * burstiness)) for _ in range(20000)]
        assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)


def test_metrics_by_hand():
    def out(ttft, latency, tokens, itl, ok=True, error=""):
        return serving_metrics.RequestOutput(success=ok, error=error, prompt_len=10, output_tokens=tokens,
                                   ttft=ttft, latency=latency, itl=itl, start=0.0, chunks=tokens,
                                   chunk_times=[ttft + sum(itl[:i]) for i in range(tokens)])

    outputs = [out(0.1, 0.5, 5, [0.1] * 4), out(0.3, 0.7, 5, [0.1] * 4),
               out(0, 0.01, 0, [], ok=False, error="HTTP 500: boom")]
    m = serving_metrics.compute_metrics(outputs, duration=2.0, goodput_slos=serving_metrics.parse_goodput(["ttft:200"]))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4 and (0.7 - 0.3) / 4
    assert m["itl_ms"]["median"] == pytest.approx(100.0)
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["errors"] == {"HTTP 500: boom": 1}
    assert m["peak_concurrent_requests"] == 3
    with pytest.raises(ValueError):
        serving_metrics.parse_goodput(["latency:5"])


def test_tokens_without_text_are_still_timed(stub):
    stub.mode = "tokenless"
    rc, printed = _run(["--base-url", _url(stub), "--model", "m", "--num-prompts", "4",
                        "--input-len", "8", "--output-len", "6"])
    assert rc == 0, printed
    assert "n/a" not in printed
    m = _metrics_of(stub, ["--num-prompts", "2", "--output-len", "6"])
    assert m["completed"] == 2 and m["total_output_tokens"] == 12
    assert m["ttft_ms"]["mean"] > 0 and m["tpot_ms"]["mean"] > 0 and m["itl_ms"]["mean"] > 0
    assert m["not_measured"] == {}


def test_unmeasurable_figures_say_na_and_why(stub, tmp_path):
    stub.mode = "onechunk"
    result_file = tmp_path / "r.json"
    rc, printed = _run(["--base-url", _url(stub), "--model", "m", "--num-prompts", "3",
                        "--input-len", "8", "--output-len", "5", "--goodput", "tpot:50",
                        "--result-file", str(result_file)])
    assert rc == 0, printed
    saved = json.loads(result_file.read_text())
    assert saved["completed"] == 3 and saved["total_output_tokens"] == 15
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert saved[key] is None and saved["not_measured"][key]
    assert saved["peak_output_throughput"] is None and saved["request_goodput"] is None
    assert saved["e2el_ms"]["mean"] > 0
    assert "TPOT (ms):" in printed and "n/a (every request's tokens arrived in one chunk" in printed
    assert re.search(r"Peak output token throughput \(tok/s\):\s+n/a \(", printed), printed
    assert " 0.00 " not in printed.split("Time to First Token")[1]


def test_json_line_separators_inside_text_do_not_split_events(stub):
    stub.mode = "u2028"
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        m = _metrics_of(stub, ["--num-prompts", "3", "--output-len", "4", "--endpoint", endpoint])
        assert m["completed"] == 3 and m["failed"] == 0, m["errors"]
        assert m["total_output_tokens"] == 12 and m["tpot_ms"] is not None


def test_several_request_rates_write_one_result_each_and_a_sweep_plot(stub, tmp_path):
    result_file = tmp_path / "sweep.json"
    plot = tmp_path / "sweep.png"
    rc, printed = _run(["--base-url", _url(stub), "--model", "m", "--num-prompts", "4",
                        "--input-len", "8", "--output-len", "3", "--request-rate", "50", "200",
                        "inf", "--goodput", "ttft:1000", "--result-file", str(result_file),
                        "--plot", str(plot)])
    assert rc == 0, printed
    for label, rate in (("50", 50.0), ("200", 200.0), ("inf", None)):
        saved = json.loads((tmp_path / f"sweep-rate{label}.json").read_text())
        assert saved["request_rate"] == rate and saved["completed"] == 4
    assert "Sweep over request rates" in printed and printed.count("Serving Benchmark Result") == 3
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert stub.count == 12


def _metrics_of(stub, argv):
    """Run against the stub, return the saved metrics (a temp file per call)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/r.json"
        rc, printed = _run(["--base-url", _url(stub), "--model", "m", "--input-len", "8",
                            "--result-file", path] + argv)
        assert rc in (0, 1), printed
        with open(path) as f:
            return json.load(f)
