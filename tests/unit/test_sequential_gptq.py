"""Sequential GPTQ (rooflm/quant/sequential.py): each linear is calibrated on the outputs of the
already quantized linears before it, in one prefill."""

import pytest
import torch

from rooflm.quant.rtn import WeightScheme

WINDOWS = [torch.randint(3, 250, (64,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
SCHEME = WeightScheme(4, 32)


def _llm(path, **kw):
    from rooflm.llm import LLM
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, quantization="none",
               enable_prefix_caching=False, **kw)


def _ppl_logprobs(llm, prompts) -> torch.Tensor:
    from rooflm.sampling_params import SamplingParams
    out = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    return torch.tensor([entry[token].logprob for o, prompt in zip(out, prompts)
                         for entry, token in zip(o.prompt_logprobs[1:], prompt[1:])])


def test_each_hessian_comes_from_the_quantized_predecessors(tmp_path):
    """The Hessian each linear was quantized with is the one the finished (all quantized) model
    feeds it, and not the float model's after the first linear."""
    from rooflm.quant.quantize import collect_hessians
    from rooflm.quant.sequential import sequential_gptq
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    total = sum(map(len, WINDOWS))
    float_h = collect_hessians(_llm(src), WINDOWS)
    llm = _llm(src, max_num_batched_tokens=total)
    used: dict = {}
    quantized = sequential_gptq(llm, WINDOWS, SCHEME, act_order=True, hessians=used)
    model = llm.engine.runner.model
    assert set(quantized) == set(float_h)
    for name, q in quantized.items():  # the model now runs the written (dequantized) weights
        assert torch.equal(model.get_submodule(name).weight, q.dequantize())
    # Inputs of a linear depend only on the linears before it: re-collecting on the quantized
    # model reproduces what each was quantized with.
    final_h = collect_hessians(llm, WINDOWS)
    first = "model.layers.0.self_attn.qkv_proj"
    for name in float_h:
        scale = float_h[name].abs().max()
        assert torch.allclose(used[name], final_h[name], rtol=1e-4, atol=1e-4 * scale), name
        if name == first:  # the embeddings feed it: nothing quantized before it
            assert torch.allclose(used[name], float_h[name], rtol=1e-4, atol=1e-4 * scale)
        else:
            assert not torch.allclose(used[name], float_h[name], rtol=1e-3, atol=1e-3 * scale), name


def test_sequential_needs_one_prefill_step(tmp_path):
    from rooflm.quant.sequential import sequential_gptq
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sequential_gptq(_llm(src, max_num_batched_tokens=128), WINDOWS, SCHEME)


def test_sequential_defaults():
    from rooflm.quant.commands import use_sequential
    assert use_sequential("gptq", None) and not use_sequential("gptq", False)
    assert not use_sequential("awq+gptq", None) and use_sequential("awq+gptq", True)
    assert not use_sequential("rtn", None)
    with pytest.raises(ValueError, match="--sequential applies"):
        use_sequential("awq", True)


def test_sequential_needs_the_kv_cache_to_hold_every_window(tmp_path):
    """A KV pool smaller than the calibration splits the prefill as surely as a small token
    budget (seen at 128 windows: 23,040 of 65,536 tokens in the step); it is refused up front."""
    from rooflm.quant.sequential import sequential_gptq
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    total = sum(map(len, WINDOWS))
    with pytest.raises(ValueError, match="cpu_kv_cache_gb"):
        sequential_gptq(_llm(src, max_num_batched_tokens=total, num_blocks=20), WINDOWS, SCHEME)
