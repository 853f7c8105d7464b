"""create_app() in-process, for embedding and quick checks (CI's server tests use real processes).

Dummy weights of SmolLM2's shape with SmolLM2's tokenizer: the text is noise,
but every path from HTTP to the engine and back is the real one.
"""

import pytest
from fastapi.testclient import TestClient

from rooflm.model.loader import resolve_model
from rooflm.server.app import create_app
from rooflm.server.config import ServerConfig


@pytest.fixture(scope="module")
def app():
    tokenizer_path, _ = resolve_model(None, "auto")
    engine_kwargs = dict(model="smollm2-135m", load_format="dummy", tokenizer=tokenizer_path,
                         max_model_len=128, num_blocks=16)
    config = ServerConfig(served_model_name="tiny", log_interval=0, max_n=2, api_key="k",
                          allowed_origins=("http://ui.example",))
    return create_app(engine_kwargs, config)


AUTH = {"Authorization": "Bearer k"}


def test_in_process_app(app):
    with TestClient(app, headers=AUTH) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                         "max_tokens": 2, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "n": 3})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
        assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 2.0' in metrics
        # The per-request series, fed on the engine thread's path too (the 400 never ran).
        labels = '{engine="0",model_name="tiny"}'
        assert f"vllm:request_generation_tokens_sum{labels} 2.0" in metrics
        assert f"vllm:request_max_num_generation_tokens_sum{labels} 2.0" in metrics
        assert f"vllm:request_prefill_time_seconds_count{labels} 1.0" in metrics
        assert f"vllm:request_decode_time_seconds_count{labels} 1.0" in metrics


def test_cors_only_for_allowed_origins(app):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with TestClient(app) as client:
        allowed = client.options("/v1/completions", headers={"Origin": "http://ui.example", **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
        other = client.options("/v1/completions", headers={"Origin": "http://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
        # The API key is still required; the 401 carries CORS headers so the page can read it.
        denied = client.get("/v1/models", headers={"Origin": "http://ui.example"})
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "http://ui.example"
        # ...and an X-Request-Id the page may read, as every answer does, preflights included.
        assert denied.headers["access-control-expose-headers"] == "X-Request-Id"
        assert len(denied.headers["x-request-id"]) == 32
        assert len(allowed.headers["x-request-id"]) == 32


def test_tokenize_without_a_tokenizer_is_a_clear_400():
    # A dummy-weight preset has no tokenizer: token ids in, token ids out, and /tokenize says why not.
    app = create_app(dict(model="smollm2-135m", load_format="dummy", max_model_len=64,
                          num_blocks=8), ServerConfig(log_interval=0, warmup=False))
    with TestClient(app) as client:
        for path, body, param in (("/tokenize", {"prompt": "Hi"}, "prompt"),
                                  ("/detokenize", {"tokens": [1, 2]}, "tokens"),
                                  ("/v1/responses", {"model": "smollm2-135m", "input": "Hi"},
                                   "input")):
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "no tokenizer" in error["message"], error
