"""`rooflm bench throughput --data-parallel-size 2` on a tiny random model (CPU): two engine
processes, each running every other request, their tokens summed over the run's wall time."""

import json

import pytest

from rooflm.cli import main
from tests.models.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)


def test_two_replicas_split_the_requests_and_sum_the_tokens(capsys, tmp_path):
    path, _ = make_tiny_model(tmp_path / "tiny", "llama")
    out_json = tmp_path / "dp.json"
    rc = main(["bench", "throughput", "--model", path, "--device", "cpu", "--disable-tqdm",
               "--num-prompts", "9", "--input-len", "12", "--output-len", "6",
               "--range-ratio", "0.5", "--data-parallel-size", "2", "--num-blocks", "64",
               "--output-json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Data-parallel replicas (tokens summed):" in out
    result = json.loads(out_json.read_text())
    replicas = result["replicas"]
    assert [r["num_requests"] for r in replicas] == [5, 4]  # requests 0,2,4,6,8 and 1,3,5,7
    assert result["num_completed"] == 9
    assert result["total_output_tokens"] == result["expected_output_tokens"]
    assert result["total_output_tokens"] == sum(r["output_tokens"] for r in replicas)
    # The run spans both replicas' clocks: at least the slower one's own time.
    assert result["elapsed_s"] >= max(r["elapsed_s"] for r in replicas)
    assert result["output_tokens_per_s"] == pytest.approx(
        result["total_output_tokens"] / result["elapsed_s"])

