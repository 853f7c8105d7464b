"""Multi-LoRA through the offline engine on a tiny Llama: PEFT adapters made in the test give
PEFT's merged model's greedy tokens, mixed in one batch with each other and the base model."""

import json
import os

import pytest
import torch

from rooflm.llm import LLM
from rooflm.lora.adapter import LoRAAdapterError, load_adapter, read_adapter_config
from rooflm.lora.request import LoRARequest
from rooflm.model.loader import load_model_config
from rooflm.sampling_params import SamplingParams
from tests.lora.adapters import ALL_TARGETS, hf_greedy, make_peft_adapter
from tests.models.tiny_models import make_tiny_model

NEW_TOKENS = 8
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 52)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    # A wider init than HF's default makes logits peaked, so argmax has no near-ties to flip.
    base_path, base = make_tiny_model(root, "llama", initializer_range=0.3)
    a1, merged1 = make_peft_adapter(base_path, root / "a1", rank=8, alpha=16, seed=1)
    a2, merged2 = make_peft_adapter(base_path, root / "a2", rank=4, alpha=8, rslora=True,
                                    targets=("q_proj", "v_proj", "down_proj"), seed=2)
    return dict(root=root, base_path=base_path, base=base, a1=a1, a2=a2, merged1=merged1, merged2=merged2,
                r1=LoRARequest("one", 1, a1), r2=LoRARequest("two", 2, a2))


def _llm(tiny, **kw):
    opts = dict(dtype="float32", device="cpu", block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    opts.update(kw)
    return LLM(model=tiny["base_path"], **opts)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_adapters_change_the_output(tiny):
    """The parity below could not fail if the adapters did nothing."""
    for prompt in PROMPTS:
        base = hf_greedy(tiny["base"], prompt, NEW_TOKENS)
        assert hf_greedy(tiny["merged1"], prompt, NEW_TOKENS) != base
        assert hf_greedy(tiny["merged2"], prompt, NEW_TOKENS) != base


def test_mixed_batch_gives_each_model_its_own_tokens(tiny):
    llm = _llm(tiny)
    prompts, loras, refs = [], [], []
    for prompt in PROMPTS:
        for lora, model in ((tiny["r1"], tiny["merged1"]), (tiny["r2"], tiny["merged2"]), (None, tiny["base"])):
            prompts.append(prompt)
            loras.append(lora)
            refs.append(hf_greedy(model, prompt, NEW_TOKENS))
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    for out, ref, lora in zip(outs, refs, loras):
        assert out.outputs[0].token_ids == ref, f"adapter {lora and lora.lora_name}"


def test_more_adapters_than_slots_wait_and_still_match(tiny):
    """--max-loras 1 with two adapters in the queue: the second waits for the first's requests
    (the base model's go beside), then gets the slot, its weights written over the first's."""
    llm = _llm(tiny, max_loras=1)
    loras = [tiny["r1"], tiny["r2"], None, tiny["r2"]]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    models = {None: tiny["base"], "one": tiny["merged1"], "two": tiny["merged2"]}
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    for out, prompt, lora in zip(outs, prompts, loras):
        ref = hf_greedy(models[lora and lora.lora_name], prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref


def test_prefix_cache_never_shares_blocks_across_adapters(tiny):
    llm = _llm(tiny)
    prompt = list(range(60, 90))  # 30 tokens: 7 whole blocks of 4
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], params, lora_request=tiny["r1"])[0]
    assert first.num_cached_tokens == 0
    same = llm.generate([prompt], params, lora_request=tiny["r1"])[0]
    assert same.num_cached_tokens > 0, "the same adapter must hit its own prefix"
    for lora in (tiny["r2"], None, LoRARequest("one", 3, tiny["a1"])):
        other = llm.generate([prompt], params, lora_request=lora)[0]
        assert other.num_cached_tokens == 0, f"{lora} hit another adapter's blocks"


def test_without_enable_lora_an_adapter_request_is_refused(tiny):
    llm = LLM(model=tiny["base_path"], dtype="float32", device="cpu", block_size=4)
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=tiny["r1"])


def test_bad_adapters_are_refused_naming_the_problem(tiny, tmp_path):
    model_cfg = load_model_config(tiny["base_path"], "safetensors")
    with pytest.raises(LoRAAdapterError, match="not a directory") as e:
        read_adapter_config(str(tmp_path / "nowhere"))
    assert e.value.status == 404
    with pytest.raises(LoRAAdapterError, match="rank 8 is over --max-lora-rank 4"):
        load_adapter("one", tiny["a1"], model_cfg, max_rank=4)
    # A target rooflm does not serve.
    bad = tmp_path / "bad_target"
    bad.mkdir()
    cfg = json.load(open(os.path.join(tiny["a1"], "adapter_config.json")))
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    (bad / "adapter_model.safetensors").write_bytes(open(os.path.join(tiny["a1"], "adapter_model.safetensors"), "rb").read())
    with pytest.raises(LoRAAdapterError, match="lm_head"):
        load_adapter("bad", str(bad), model_cfg, max_rank=8)
    # A target the config names but the weights lack.
    (bad / "adapter_config.json").write_text(json.dumps({**json.load(open(os.path.join(tiny["a2"], "adapter_config.json"))),
                                                         "target_modules": ["q_proj", "v_proj", "down_proj", "o_proj"]}))
    (bad / "adapter_model.safetensors").write_bytes(open(os.path.join(tiny["a2"], "adapter_model.safetensors"), "rb").read())
    with pytest.raises(LoRAAdapterError, match=r"targets \['o_proj'\] but"):
        load_adapter("bad", str(bad), model_cfg, max_rank=8)
    # An adapter trained on another base: its shapes do not fit.
    other_path, _ = make_tiny_model(tmp_path, "llama", hidden_size=32, intermediate_size=64, name="other")
    other, _ = make_peft_adapter(other_path, tmp_path / "other_adapter", rank=4, alpha=4)
    with pytest.raises(LoRAAdapterError, match=r"has lora_A \(4, \d+\) and lora_B \(\d+, 4\); the base model"):
        load_adapter("other", other, model_cfg, max_rank=8)
    # Through the engine: a 400-style InvalidRequest on the `model` field, nothing queued.
    llm = _llm(tiny, max_lora_rank=4)
    from rooflm.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="rank 8 is over") as e:
        llm.generate([PROMPTS[0]], GREEDY, lora_request=tiny["r1"])
    assert e.value.param == "model"
    assert not llm.engine.has_unfinished_requests()


def test_the_hook_is_absent_without_enable_lora(tiny):
    llm = LLM(model=tiny["base_path"], dtype="float32", device="cpu", block_size=4)
    model = llm.engine.runner.model
    from rooflm.layers.linear import Linear
    assert all(m.lora is None for m in model.modules() if isinstance(m, Linear))
    assert all(layer.lora_mapping is None for layer in model.model.layers)
    assert llm.engine.runner.lora is None


def test_the_adapter_crosses_the_engine_core_socket():
    from rooflm.engine import core_protocol
    from rooflm.engine.request_types import GenerateRequest

    lora = LoRARequest("one", 1, "/adapters/one")
    msg = core_protocol.AddRequests(batch_id=1, requests=[
        GenerateRequest("a", [1, 2], SamplingParams(max_tokens=3), lora_request=lora),
        GenerateRequest("b", [1], SamplingParams(max_tokens=3))])
    back = core_protocol.input_decoder().decode(core_protocol.encoder().encode(msg))
    assert [r.lora_request for r in back.requests] == [lora, None]


@pytest.mark.gpu
def test_gpu_mixed_batch_equals_single_adapter_runs(tiny):
    """On CUDA the hooks run the Triton SGMV kernels (prefill and decode; one sequence: the GEMV chain): a mixed batch
    gives each request what it gets alone, and PEFT's merged model's tokens (fp32)."""
    llm = _llm(tiny, device="cuda")
    loras = [tiny["r1"], tiny["r2"], None] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(3)]
    mixed = llm.generate(prompts, GREEDY, lora_request=loras)
    models = {None: tiny["base"], "one": tiny["merged1"], "two": tiny["merged2"]}
    for out, prompt, lora in zip(mixed, prompts, loras):
        alone = llm.generate([prompt], GREEDY, lora_request=lora)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].token_ids == hf_greedy(models[lora and lora.lora_name], prompt, NEW_TOKENS)
