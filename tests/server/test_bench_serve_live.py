"""`rooflm bench serve` against a live `rooflm serve` on 127.0.0.1 (short and bounded)."""

import json

import pytest

from rooflm.bench.client_pool import arrival_offsets
from rooflm.cli import main
from tests.server.server_utils import API_KEY, MODEL

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dataset", ["random", "prefix"])
def test_bench_serve_against_live_server(server, tmp_path, capsys, dataset):
    result_file = tmp_path / f"{dataset}.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--api-key", API_KEY,
               "--dataset-name", dataset, "--num-prompts", "6", "--input-len", "24", "--prefix-len", "16",
               "--output-len", "4", "--max-concurrency", "2", "--vocab-size", "49152",
               "--request-timeout", "60", "--result-file", str(result_file), "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(result_file.read_text())
    metrics = result.get("metrics", result)
    assert metrics["completed"] == 6 and metrics["failed"] == 0, printed
    assert "Successful requests:" in printed and "TTFT" in printed
    assert metrics["total_output_tokens"] > 0 and metrics["ttft_ms"]["mean"] > 0
    # The server's own TTFT, from its /metrics histogram before and after: these 6 requests.
    server_ttft = metrics["server_ttft_ms"]
    assert server_ttft["count"] == 6 and 0 < server_ttft["median"] <= server_ttft["p99"], printed
    assert "TTFT at the server" in printed and 0 < metrics["client_cpu_busy"] < 2


def test_bench_serve_on_a_dummy_model_directory(tmp_path, capsys):
    """An HF directory with a real tokenizer and no weights, served with --load-format dummy:
    text streams per token, so TTFT/TPOT/ITL are all measured, at two request rates."""
    import httpx

    from rooflm.tokenizer.dummy_model_dir import make_dummy_model_dir
    from tests.server.server_utils import SMALL_ENGINE_ARGS, start_server

    model_dir = tmp_path / "smollm2-dummy"
    make_dummy_model_dir("smollm2-135m", str(model_dir), "default", max_position_embeddings=512)
    server = start_server(tmp_path, "dummy-dir", ["--model", str(model_dir), "--load-format", "dummy",
                                                  *SMALL_ENGINE_ARGS])
    try:
        server.wait_ready()
        reply = httpx.post(server.url + "/v1/completions", timeout=240, json={
            "model": "smollm2-dummy", "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text
        result_file = tmp_path / "dummy.json"
        rc = main(["bench", "serve", "--base-url", server.url, "--model", "smollm2-dummy",
                   "--num-prompts", "3", "--input-len", "12", "--output-len", "4", "--ignore-eos",
                   "--prompt-format", "words", "--request-rate", "20", "inf",
                   "--request-timeout", "240", "--result-file", str(result_file), "--disable-tqdm"])
        printed = capsys.readouterr().out
        assert rc == 0, printed
        for rate in ("20", "inf"):
            metrics = json.loads((tmp_path / f"dummy-rate{rate}.json").read_text())
            assert metrics["completed"] == 3 and metrics["total_output_tokens"] == 12, printed
            assert metrics["not_measured"] == {}, printed
            assert metrics["ttft_ms"]["mean"] > 0 and metrics["tpot_ms"]["mean"] > 0
        check_several_client_processes(server.url, tmp_path, capsys)
    finally:
        server.stop()


def check_several_client_processes(url, tmp_path, capsys):
    """Two client processes share one arrival schedule. Run against a server with the default
    queue limit (64): the shared session server's limit of 4 fills on a slow CI machine while
    a 20 req/s burst waits for its first step, and a 429 there says nothing about the pool."""
    result_file = tmp_path / "pool.json"
    rc = main(["bench", "serve", "--base-url", url, "--model", "smollm2-dummy",
               "--num-prompts", "6", "--input-len", "12", "--output-len", "4", "--ignore-eos",
               "--prompt-format", "words", "--request-rate", "20", "--client-processes", "2",
               "--request-timeout", "240", "--result-file", str(result_file), "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    metrics = json.loads(result_file.read_text())
    assert metrics["completed"] == 6 and metrics["failed"] == 0 and metrics["client_processes"] == 2, printed
    # Merged back in request order, each sent at its own offset on the shared schedule: never
    # before it. (How late is the machine's business: on a loaded one the client processes start
    # after the shared start, and send what is due at once.)
    offsets = arrival_offsets(6, 20.0, 1.0, seed=0)
    starts = [r["start"] for r in metrics["requests"]]
    assert len(starts) == 6 and all(s >= o - 0.02 for s, o in zip(starts, offsets)), (starts, offsets)
    assert metrics["server_ttft_ms"]["count"] == 6
    assert "busiest of 2" in printed
