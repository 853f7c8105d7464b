"""`rooflm bench serve` against a live `rooflm serve` on 127.0.0.1 (short and bounded)."""

import json

import pytest

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
