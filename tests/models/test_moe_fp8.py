"""`--quantization fp8` on a mixture of experts (rooflm/model/quantize_on_load.py): the stacked
experts become E4M3 codes with per-channel scales beside the FP8 linears, the engine's byte
counts say so, and the logits stay near the float model's. CPU, tiny Qwen3-MoE."""

import pytest
import torch

from rooflm.layers.moe import Experts
from tests.models.test_moe_parity import make_tiny_moe

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 50))]


def _llm(path, **kw):
    from rooflm.llm import LLM
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, enable_prefix_caching=False, **kw)


def _prompt_logprobs(llm) -> torch.Tensor:
    from rooflm.sampling_params import SamplingParams
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    return torch.tensor([entry[token].logprob for o, prompt in zip(out, PROMPTS)
                         for entry, token in zip(o.prompt_logprobs[1:], prompt[1:])])


def test_quantization_fp8_converts_the_experts(tmp_path, monkeypatch):
    path, _ = make_tiny_moe(tmp_path, "qwen3_moe")
    llm = _llm(path, quantization="fp8")
    runner = llm.engine.runner
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(e.w13.dtype == torch.float8_e4m3fn and e.quant_format == "fp8" for e in experts)
    assert llm.engine.info.matmul_dtype == "fp8"
    # one byte a weight plus per-channel scales: the experts counted as stored, not as bf16/fp32
    assert 1.0 < llm.engine.info.weight_dtype_bytes < 1.2
    stored = runner.weight_bytes()
    float_llm = _llm(path, quantization="none")
    expert_floats = sum(e.weight_count() for e in experts)
    assert float_llm.engine.runner.weight_bytes() - stored > 2.5 * expert_floats  # 4 -> ~1 byte each
    fp8, ref = _prompt_logprobs(llm), _prompt_logprobs(float_llm)
    # This random tiny model (initializer_range 0.3) drifts ~0.3 nats under FP8 linears alone;
    # the experts' W8A8 may add to it as much again, not the orders of magnitude of wrong scales.
    monkeypatch.setattr(Experts, "quantize_fp8", lambda self: None)
    linears_only = _prompt_logprobs(_llm(path, quantization="fp8"))
    drift, linears_drift = (fp8 - ref).abs().mean(), (linears_only - ref).abs().mean()
    assert not torch.equal(fp8, linears_only) and 0 < drift < 2 * linears_drift, (drift, linears_drift)
