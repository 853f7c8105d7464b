"""Sequential GPTQ (rooflm/quantize/sequential.py): each linear is calibrated on the outputs of the
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
    from rooflm.quantize.quantize import collect_hessians
    from rooflm.quantize.sequential import sequential_gptq
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
    from rooflm.quantize.sequential import sequential_gptq
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sequential_gptq(_llm(src, max_num_batched_tokens=128), WINDOWS, SCHEME)


def test_sequential_defaults():
    from rooflm.quantize.commands import use_sequential
    assert use_sequential("gptq", None) and not use_sequential("gptq", False)
    assert not use_sequential("awq+gptq", None) and use_sequential("awq+gptq", True)
    assert not use_sequential("rtn", None)
    with pytest.raises(ValueError, match="--sequential applies"):
        use_sequential("awq", True)


def test_sequential_needs_the_kv_cache_to_hold_every_window(tmp_path):
    """A KV pool smaller than the calibration splits the prefill as surely as a small token
    budget (seen at 128 windows: 23,040 of 65,536 tokens in the step); it is refused up front."""
    from rooflm.quantize.sequential import sequential_gptq
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    total = sum(map(len, WINDOWS))
    with pytest.raises(ValueError, match="cpu_kv_cache_gb"):
        sequential_gptq(_llm(src, max_num_batched_tokens=total, num_blocks=20), WINDOWS, SCHEME)


def test_asymmetric_target_is_the_least_squares_fit_of_the_float_outputs():
    """GPTQv2's target W' (alpha 1, no ridge) is the least-squares map from the quantized inputs
    X~ to the float outputs W X; alpha 0 is W itself, and alpha scales the correction."""
    from rooflm.quantize.gptq import asymmetric_target
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 64, generator=g, dtype=torch.float64).float()
    xq = x + 0.1 * torch.randn(2000, 64, generator=g)
    w = torch.randn(16, 64, generator=g)
    h, cross = xq.T @ xq, (x - xq).T @ xq
    fit = torch.linalg.lstsq(xq, x @ w.T).solution.T
    full = asymmetric_target(w, h, cross, 1.0, damp=1e-9)
    assert torch.allclose(full, fit, atol=1e-4), (full - fit).abs().max()
    assert (w - fit).abs().max() > 0.02  # the inputs differ enough for the fit to move
    assert torch.equal(asymmetric_target(w, h, cross, 0.0), w)
    half = asymmetric_target(w, h, cross, 0.5, damp=1e-9)
    assert torch.allclose(half, w + 0.5 * (full - w), atol=1e-5)
    with pytest.raises(ValueError, match="alpha"):
        asymmetric_target(w, h, cross, 1.5)


def test_gptq_v2_fits_each_linear_to_the_float_outputs(tmp_path):
    """With --gptq-v2 the first linear (fed by the embeddings: nothing quantized before it) is
    quantized as plain sequential GPTQ quantizes it; a later one is fitted to the float model's
    outputs, so its asymmetric loss ||X W^T - X~ Q^T|| is below that of plain GPTQ on the same
    quantized inputs X~ (which aims at X~ W^T instead)."""
    from rooflm.quantize.gptq import gptq_quantize
    from rooflm.quantize.sequential import capture_inputs, sequential_gptq
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    total = sum(map(len, WINDOWS))
    float_llm = _llm(src, max_num_batched_tokens=total)
    x_float = capture_inputs(float_llm, WINDOWS)
    plain = sequential_gptq(_llm(src, max_num_batched_tokens=total), WINDOWS, SCHEME)
    llm = _llm(src, max_num_batched_tokens=total)
    v2 = sequential_gptq(llm, WINDOWS, SCHEME, v2_alpha=1.0)
    first = "model.layers.0.self_attn.qkv_proj"
    assert torch.equal(v2[first].codes, plain[first].codes)
    x_quant = capture_inputs(llm, WINDOWS)  # the inputs each linear was quantized with
    name = "model.layers.1.mlp.down_proj"
    w = float_llm.engine.runner.model.get_submodule(name).weight.detach().float()
    target = x_float[name] @ w.T
    q_plain = gptq_quantize(w, x_quant[name].T @ x_quant[name], SCHEME.bits, SCHEME.group_size)

    def loss(q):
        return (target - x_quant[name] @ q.dequantize().T).square().sum()
    assert loss(v2[name]) < 0.9 * loss(q_plain), (loss(v2[name]), loss(q_plain))
