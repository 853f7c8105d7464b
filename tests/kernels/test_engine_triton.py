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
