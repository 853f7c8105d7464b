"""/metrics parses as Prometheus text, uses vLLM's names, types, labels and buckets,
and counts exactly what a test did."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rooflm.server import metrics as server_metrics
from tests.server.server_utils import MODEL, assert_idle, metric, scrape, wait_until_idle

# A real server process: the real model, bounded in time even without --timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "rooflm:step_time_seconds": "histogram",
    "rooflm:kv_free_blocks": "gauge",
    "rooflm:kv_num_blocks": "gauge",
    "rooflm:tokens_in_flight": "gauge",
}


def _families(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_names_types_labels_and_buckets(server):
    families = _families(server.url)
    for name, kind in EXPECTED_TYPES.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    ttft_bounds = [float(s.labels["le"]) for s in families["vllm:time_to_first_token_seconds"].samples
                   if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert ttft_bounds == server_metrics.TTFT_BUCKETS
    # Token-count buckets: vLLM's 1-2-5 ladder up to the context length (512 here).
    token_bounds = [float(s.labels["le"]) for s in families["vllm:request_prompt_tokens"].samples
                    if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert token_bounds == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    # The peak bandwidth is unknown on this server: no MBU series rather than a made-up one.
    assert not families.get("rooflm:mbu") or not families["rooflm:mbu"].samples
    assert "vllm:prompt_tokens_created" not in httpx.get(server.url + "/metrics").text


def test_counts_what_the_test_did(server, auth):
    assert_idle(wait_until_idle(server.url))
    before = scrape(server.url)
    completion = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60, json={
        "model": MODEL, "prompt": "Counting metrics, one", "max_tokens": 5, "ignore_eos": True})
    chat = httpx.post(server.url + "/v1/chat/completions", headers=auth, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Counting metrics, two"}],
        "max_tokens": 3, "ignore_eos": True, "stream": True})
    assert completion.status_code == 200 and chat.status_code == 200
    after = wait_until_idle(server.url)
    assert_idle(after)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt_tokens = completion.json()["usage"]["prompt_tokens"]
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:generation_tokens_total") == 5 + 3
    assert delta("vllm:prompt_tokens_total") > prompt_tokens  # plus the chat prompt
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == (5 - 1) + (3 - 1)
    assert delta("vllm:prefix_cache_queries_total") == delta("vllm:prompt_tokens_total")
    assert 0 <= delta("vllm:prefix_cache_hits_total") <= delta("vllm:prefix_cache_queries_total")
    assert delta("rooflm:step_time_seconds_count") >= 5
    assert delta("vllm:num_preemptions_total") == 0
    # Per request (vLLM's dashboard): sizes of both, their max_tokens, prefill and decode times.
    assert delta("vllm:request_prompt_tokens_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == delta("vllm:prompt_tokens_total")
    assert delta("vllm:request_generation_tokens_count") == 2
    assert delta("vllm:request_generation_tokens_sum") == 5 + 3
    assert delta("vllm:request_generation_tokens_bucket", le="5.0") == 2
    assert delta("vllm:request_generation_tokens_bucket", le="2.0") == 0
    assert delta("vllm:request_max_num_generation_tokens_sum") == 5 + 3  # n = 1: the same
    assert delta("vllm:request_prefill_time_seconds_count") == 2
    assert delta("vllm:request_decode_time_seconds_count") == 2
    # Prefill + decode fit inside end-to-end (queueing is the rest).
    phases = delta("vllm:request_prefill_time_seconds_sum") + delta(
        "vllm:request_decode_time_seconds_sum")
    assert 0 < phases <= delta("vllm:e2e_request_latency_seconds_sum") + 1e-6
    assert delta("vllm:request_decode_time_seconds_sum") > 0  # 5 and 3 tokens: several steps


def test_parallel_samples_in_the_per_request_histograms(server, auth):
    """n = 2: request_generation_tokens counts both samples, request_max_num_generation_tokens the
    longest (vLLM's parallel-sampling rule); one observation each per request."""
    assert_idle(wait_until_idle(server.url))
    before = scrape(server.url)
    out = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60, json={
        "model": MODEL, "prompt": "Two samples", "max_tokens": 3, "n": 2, "ignore_eos": True,
        "temperature": 1.0, "seed": 3})
    assert out.status_code == 200, out.text
    after = wait_until_idle(server.url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:request_generation_tokens_count") == 1
    assert delta("vllm:request_generation_tokens_sum") == 2 * 3
    assert delta("vllm:request_max_num_generation_tokens_count") == 1
    assert delta("vllm:request_max_num_generation_tokens_sum") == 3
    assert delta("vllm:request_prompt_tokens_sum") == out.json()["usage"]["prompt_tokens"]
