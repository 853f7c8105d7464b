"""LoRA adapters through the real FastAPI stack (create_app, the engine on its thread): the
`model` field picks the adapter, /v1/models lists them, load/unload at run time behind
ROOFLM_ALLOW_RUNTIME_LORA_UPDATING, and bad names and paths get 404/400 naming the problem."""

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

import rooflm.envs as envs
from rooflm.server.app import create_app
from rooflm.server.config import ServerConfig
from tests.lora.adapters import hf_greedy, make_peft_adapter
from tests.models.tiny_models import make_tiny_model_with_tokenizer
from tests.server.server_utils import assert_openai_error

PROMPT = [5, 17, 42, 99, 3, 250, 7]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base_path = make_tiny_model_with_tokenizer(root)
    a1, merged1 = make_peft_adapter(base_path, root / "a1", rank=8, alpha=16, seed=1)
    a2, merged2 = make_peft_adapter(base_path, root / "a2", rank=4, alpha=8, rslora=True, seed=2,
                                    targets=("q_proj", "v_proj", "gate_proj"))
    import transformers
    import torch
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    texts = {name: tokenizer.decode(hf_greedy(model, PROMPT, NEW_TOKENS))
             for name, model in (("base", base), ("one", merged1), ("two", merged2))}
    engine_kwargs = dict(model=base_path, dtype="float32", device="cpu", block_size=4, num_blocks=64,
                         enable_lora=True, max_loras=2, max_lora_rank=8)
    config = ServerConfig(served_model_name="base", log_interval=0, warmup=False, lora_modules=(f"one={a1}",))
    with envs.override("ROOFLM_ALLOW_RUNTIME_LORA_UPDATING", "1"):
        app = create_app(engine_kwargs, config)
    return dict(app=app, a1=a1, a2=a2, texts=texts, root=root)


def _complete(client, model):
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                "temperature": 0, "ignore_eos": True})


def test_model_field_selects_the_adapter_and_load_unload_work(served):
    texts = served["texts"]
    assert len(set(texts.values())) == 3, "the adapters must change the output, or the test proves nothing"
    with TestClient(served["app"]) as client:
        models = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("one", "base")]
        assert models[1]["root"] == served["a1"]
        assert client.get("/v1/models/one").json()["parent"] == "base"
        for model in ("base", "one"):
            response = _complete(client, model)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"].strip() == texts[model].strip()
        # An adapter that is not (yet) loaded: 404 naming the model.
        error = assert_openai_error(_complete(client, "two"), 404)
        assert "`two`" in error["message"] and error["param"] == "model"
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": served["a2"]})
        assert response.status_code == 200, response.text
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base", "one", "two"]
        response = _complete(client, "two")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].strip() == texts["two"].strip()
        # Loading a name twice, a path with nothing there, an unknown unload.
        error = assert_openai_error(client.post("/v1/load_lora_adapter",
                                                json={"lora_name": "two", "lora_path": served["a2"]}), 400)
        assert "already been loaded" in error["message"]
        missing = str(served["root"] / "missing")
        error = assert_openai_error(client.post("/v1/load_lora_adapter",
                                                json={"lora_name": "three", "lora_path": missing}), 404)
        assert missing in error["message"] and "not a directory" in error["message"]
        no_config = served["root"]  # a directory, but no adapter_config.json
        error = assert_openai_error(client.post("/v1/load_lora_adapter",
                                                json={"lora_name": "three", "lora_path": str(no_config)}), 404)
        assert "adapter_config.json" in error["message"]
        error = assert_openai_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404)
        assert "nope" in error["message"]
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "two"}).status_code == 200
        assert_openai_error(_complete(client, "two"), 404)
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base", "one"]


def test_runtime_endpoints_are_off_without_the_switch(served, tmp_path):
    base_app_kwargs = dict(model=make_tiny_model_with_tokenizer(tmp_path), dtype="float32", device="cpu",
                           block_size=4, num_blocks=16, enable_lora=True)
    with envs.override("ROOFLM_ALLOW_RUNTIME_LORA_UPDATING", None):
        app = create_app(base_app_kwargs, ServerConfig(log_interval=0, warmup=False))
    with TestClient(app) as client:
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": served["a2"]})
        assert response.status_code == 404


def test_a_bad_lora_module_at_start_up_names_it(served, tmp_path):
    kwargs = dict(model=make_tiny_model_with_tokenizer(tmp_path), dtype="float32", device="cpu",
                  block_size=4, num_blocks=16, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"--lora-modules one=.*rank 8 is over --max-lora-rank 4"):
        create_app(kwargs, ServerConfig(log_interval=0, warmup=False, lora_modules=(f"one={served['a1']}",)))
    with pytest.raises(ValueError, match="name=path"):
        create_app(kwargs, ServerConfig(log_interval=0, warmup=False, lora_modules=("nopath",)))
