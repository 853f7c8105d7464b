"""`rooflm serve --speculative-method ngram`: the engine-core process speculates, and the
vllm:spec_decode_* series count what it did."""

import httpx
import pytest

from tests.server.server_utils import SMALL_ENGINE_ARGS, metric, scrape, start_server


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    process = start_server(tmp_path_factory.mktemp("spec"), "spec",
                           SMALL_ENGINE_ARGS + ["--speculative-method", "ngram",
                                                "--num-speculative-tokens", "3", "--speculative-policy", "budget"])
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_server_speculates_and_reports_it(spec_server):
    # Ends inside the pattern, so the model continues it and the prompt lookup's drafts match.
    text = "one two three four five six seven eight nine ten " * 3 + "one two three"
    body = {"model": "SmolLM2-135M-Instruct", "prompt": text, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 12
    samples = scrape(spec_server.url)
    drafts = metric(samples, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert metric(samples, "vllm:spec_decode_num_drafts_total") > 0
    assert drafts >= accepted > 0  # a repeated text continues as it went
    assert metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
