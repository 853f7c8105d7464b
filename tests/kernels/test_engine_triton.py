"""The whole Triton path inside the engine (fused RoPE/KV write, prefill and decode attention,
RMSNorm, SiLU-and-mul) against the torch reference path, on a tiny model.

On the CPU this runs under Triton's interpreter (see conftest.py), so shapes stay tiny.
"""

import pytest

from rooflm import LLM, SamplingParams
from tests.kernels.conftest import DEVICE
from tests.models.tiny_models import make_tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_backend_matches_reference_in_engine(tmp_path, family):
    path, _ = make_tiny_model(tmp_path, family, initializer_range=0.3)
    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [30, 31, 32], [5, 17, 42, 99, 3, 250, 7, 8, 9, 1]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # A small budget forces chunked prefill; the shared prompt head gives a prefix hit.
    kw = dict(model=path, device=DEVICE, dtype="float32", block_size=4, max_num_batched_tokens=8,
              enforce_eager=True)
    ref = LLM(attention_backend="reference", **kw).generate(prompts, params)
    fast_llm = LLM(attention_backend="triton", **kw)
    fast = fast_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in ref]
    assert fast_llm.engine.runner.backend.name == "triton"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_batch1_decode_gemv_path_matches_reference(tmp_path, family):
    """One sequence: every step has one token, so the fused GEMV layer path runs (qkv bias in
    qwen2, q/k norms in qwen3) and its tokens and logprobs must match the reference path's."""
    path, _ = make_tiny_model(tmp_path, family, initializer_range=0.3)
    prompt = [[5, 17, 42, 99, 3, 250, 7]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    kw = dict(model=path, device=DEVICE, dtype="float32", block_size=4, enforce_eager=True)
    ref = LLM(attention_backend="reference", **kw).generate(prompt, params)[0].outputs[0]
    llm = LLM(attention_backend="triton", **kw)
    assert llm.engine.runner.model.model.layers[0].gemv is not None
    fast = llm.generate(prompt, params)[0].outputs[0]
    assert fast.token_ids == ref.token_ids
    for a, b in zip(fast.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    off = LLM(attention_backend="triton", decode_gemv=False, **kw)
    assert off.engine.runner.model.model.layers[0].gemv is None
    assert off.generate(prompt, params)[0].outputs[0].token_ids == ref.token_ids


def _count_gemv_rows(monkeypatch) -> list[int]:
    """Token counts of every multi-row GEMV call (gemv dispatches through the module's name)."""
    from rooflm.kernels import gemv as gemv_module
    calls, original = [], gemv_module.gemv_rows

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv_rows", counting)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_few_sequence_decode_takes_gemv_rows_and_matches_reference(tmp_path, monkeypatch, family):
    """Three sequences: their decode steps (3 tokens) run the layers and the LM head through the
    multi-row GEMV; tokens and logprobs match the reference path's."""
    calls = _count_gemv_rows(monkeypatch)
    path, _ = make_tiny_model(tmp_path, family, initializer_range=0.3)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [30, 31, 32], [8, 9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    kw = dict(model=path, device=DEVICE, dtype="float32", block_size=4, enforce_eager=True)
    ref = LLM(attention_backend="reference", **kw).generate(prompts, params)
    llm = LLM(attention_backend="triton", **kw)
    assert llm.engine.runner.model.model.layers[0].gemv_max_rows >= 3
    fast = llm.generate(prompts, params)
    assert 3 in calls
    for a, b in zip(fast, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-3 for t in la)


def test_speculative_verify_forwards_take_gemv_rows(tmp_path, monkeypatch):
    """The target drafting for itself: verify forwards of 1 + k tokens run through the multi-row
    GEMV, accept every draft, and give plain decoding's tokens (the reference path's)."""
    calls = _count_gemv_rows(monkeypatch)
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    prompt = [[5, 17, 42, 99, 3, 250, 7]]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    kw = dict(model=path, device=DEVICE, dtype="float32", block_size=4, enforce_eager=True)
    ref = LLM(attention_backend="reference", **kw).generate(prompt, params)[0].outputs[0]
    llm = LLM(attention_backend="triton", speculative_method="draft", draft_model=path, num_speculative_tokens=3,
              speculative_max_batch_tokens=512, speculative_policy="budget", **kw)
    out = llm.generate(prompt, params)[0].outputs[0]
    stats = llm.engine.snapshot().spec
    assert out.token_ids == ref.token_ids
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert 4 in calls  # a verify forward: the last token and its 3 drafts
