"""vLLM surfaces that tools probe, through the real FastAPI app (create_app, the engine on its
thread): GET /tokenizer_info (lm-eval), stream_options.continuous_usage_stats (guidellm), unknown
nested request fields in the log, and the LoRA metrics (vllm:lora_requests_info, per-adapter
request counts)."""

import json
import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from rooflm.server import protocol as p
from rooflm.server.app import create_app
from rooflm.server.config import ServerConfig
from rooflm.server.metrics import ServerMetrics
from tests.lora.adapters import make_peft_adapter
from tests.models.tiny_models import make_tiny_model_with_tokenizer

PROMPT = [5, 17, 42, 99, 3, 250, 7]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_surfaces")
    base_path = make_tiny_model_with_tokenizer(root)
    a1, _ = make_peft_adapter(base_path, root / "a1", rank=8, alpha=16, seed=1)
    engine_kwargs = dict(model=base_path, dtype="float32", device="cpu", block_size=4, num_blocks=64,
                         enable_lora=True, max_loras=1, max_lora_rank=8)
    config = ServerConfig(served_model_name="base", log_interval=0, warmup=False, lora_modules=(f"one={a1}",),
                          chat_template=CHAT_TEMPLATE)
    return dict(app=create_app(engine_kwargs, config), base_path=base_path)


# ---- /tokenizer_info -----------------------------------------------------------------------------


def test_tokenizer_info_has_the_tokenizer_config_shape(served):
    hf = AutoTokenizer.from_pretrained(served["base_path"])
    with TestClient(served["app"]) as client:
        response = client.get("/tokenizer_info")
        assert response.status_code == 200, response.text
        info = response.json()
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert info["tokenizer_class"] == type(hf).__name__
    assert info["eos_token"] == str(hf.eos_token)
    assert info["model_max_length"] == max_model_len
    assert info["chat_template"] == CHAT_TEMPLATE, "the template the server renders with"
    # What the client can rebuild the tokenizer's special tokens from, and nothing of the server's files.
    for key in ("name_or_path", "tokenizer_file", "vocab_file"):
        assert key not in info
    json.dumps(info)


# ---- stream_options.continuous_usage_stats -------------------------------------------------------


def _stream(client, stream_options, path="/v1/completions", **extra):
    body = {"model": "base", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": stream_options, **extra}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_usage_in_every_chunk(served, path):
    with TestClient(served["app"]) as client:
        chunks = _stream(client, {"include_usage": True, "continuous_usage_stats": True}, path)
    content = [c for c in chunks[:-1] if c.get("usage") is not None]
    assert content, "no chunk carried usage"
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    prompt_tokens = final["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 5, counts
    for c in content:
        u = c["usage"]
        assert u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
    # Every chunk that brought generated tokens carried the usage with them.
    token_chunks = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                          (c["choices"][0].get("delta") or {}).get("content"))]
    assert all(c.get("usage") is not None for c in token_chunks)


def test_without_continuous_usage_only_the_last_chunk_has_usage(served):
    with TestClient(served["app"]) as client:
        chunks = _stream(client, {"include_usage": True})
        plain = _stream(client, {"include_usage": False, "continuous_usage_stats": True})
    assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c.get("usage") is None for c in plain), "continuous_usage_stats counts only with include_usage"


# ---- unknown nested fields -----------------------------------------------------------------------


def test_unknown_nested_fields_are_named_with_their_path():
    request = p.validate_request(p.ChatCompletionRequest, {
        "model": "m", "top_secret": 1, "stream": True,
        "stream_options": {"include_usage": True, "surely_unknown": 1},
        "messages": [{"role": "user", "content": "hi", "weight": 2},
                     {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]},
                     {"role": "user", "content": "again", "weight": 3}]})
    assert p.ignored_fields(request) == ["messages[].content[].cache_control", "messages[].weight",
                                         "stream_options.surely_unknown", "top_secret"]


def test_unknown_nested_fields_reach_the_log(served, caplog):
    with TestClient(served["app"]) as client, caplog.at_level(logging.WARNING, logger="rooflm.server.state"):
        response = client.post("/v1/completions", json={
            "model": "base", "prompt": PROMPT, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True, "nested_unknown": True}},
            headers={"X-Request-Id": "nested-77"})
        assert response.status_code == 200
    assert "request nested-77: ignoring unknown request fields: stream_options.nested_unknown" in caplog.text


# ---- LoRA metrics --------------------------------------------------------------------------------


def _samples(text: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_lora_metrics_name_the_adapters_and_count_their_requests(served):
    with TestClient(served["app"]) as client:
        for model in ("one", "one", "base"):
            response = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
            assert response.status_code == 200, response.text
        text = client.get("/metrics").text
    info = _samples(text, "vllm:lora_requests_info")
    assert len(info) == 1
    assert info[0].labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert info[0].value > 1e9, "the value is the wall-clock time of the update"
    counts = {s.labels["lora_name"]: s.value for s in _samples(text, "rooflm:lora_requests_total")}
    assert counts == {"one": 2.0}, "the base model's request is no adapter's"


def test_lora_info_gauge_lists_running_and_waiting_adapters():
    metrics = ServerMetrics("base")
    metrics.set_lora_state(2, {"b": 1, "a": 3}, {"c": 1}, {"a": 3, "b": 1, "c": 1})
    metrics.set_lora_state(2, {"a": 2}, {"c": 1}, {"a": 1})
    text = metrics.render().decode()
    info = _samples(text, "vllm:lora_requests_info")
    assert [s.labels for s in info] == [{"max_lora": "2", "running_lora_adapters": "a",
                                         "waiting_lora_adapters": "c"}], "only the current series"
    running = {s.labels["lora_name"]: s.value for s in _samples(text, "rooflm:lora_requests_running")}
    assert running == {"a": 2.0, "b": 0.0, "c": 0.0}
    total = {s.labels["lora_name"]: s.value for s in _samples(text, "rooflm:lora_requests_total")}
    assert total == {"a": 4.0, "b": 1.0, "c": 1.0}
