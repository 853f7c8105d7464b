"""AWQ (rooflm/quantize/awq.py): the scale fold is exact in float, the searched scales lower the
quantization error against RTN, and `rooflm quantize --method awq|awq+gptq` writes a GPTQ-layout
checkpoint rooflm loads."""

import json
import os

import pytest
import torch

from rooflm.quantize.awq import AwqConfig, apply_awq, clipped_rtn_int4, fold_scales, search_scale
from rooflm.quant.rtn import WeightScheme, rtn_int4

PROMPTS = [[5, 9, 17, 33, 2, 71, 14, 88], [7, 3, 120, 44]]


def _llm(path):
    from rooflm.llm import LLM
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, quantization="none",
               enable_prefix_caching=False)


def _logits(llm) -> torch.Tensor:
    """The logprob of each prompt token after its prefix (the engine's own prefill): one number
    per position that any change to the model's output distribution moves."""
    from rooflm.sampling_params import SamplingParams
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    return torch.tensor([entry[token].logprob for o, prompt in zip(out, PROMPTS)
                         for entry, token in zip(o.prompt_logprobs[1:], prompt[1:])])


def _salient_model(tmp_path) -> str:
    """A tiny Llama (GQA) whose norms make a few input channels 8x larger than the rest, as the
    outlier channels of trained LLMs are (what AWQ protects); random tiny weights have none."""
    from tests.models.tiny_models import make_tiny_model
    src, hf = make_tiny_model(tmp_path, "llama", attention="gqa")
    with torch.no_grad():
        for layer in hf.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40, 51]] *= 8.0
    hf.save_pretrained(src, safe_serialization=True)
    return src


@pytest.mark.parametrize("family,attention", [("llama", "gqa"), ("qwen2", "mha")])
def test_scale_fold_leaves_the_float_model_unchanged(tmp_path, family, attention):
    """Random positive scales on all four seams (norms, v rows under GQA, up rows): the float
    model's next-token distributions stay the same to fp32 rounding."""
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, family, attention=attention)
    llm = _llm(src)
    before = _logits(llm)
    model = llm.engine.runner.model
    g = torch.Generator().manual_seed(3)
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q_size = attn.o_proj.in_features
        kv_size = attn.qkv_proj.shard_offsets["v"][1]
        head_dim = attn.cfg.head_dim
        s_o = torch.rand(kv_size // head_dim, 1, head_dim, generator=g) + 0.5  # tied over the group
        s_o = s_o.expand(-1, q_size // kv_size, -1).reshape(-1)
        scales = {f"model.layers.{index}.self_attn.qkv_proj": torch.rand(attn.qkv_proj.in_features, generator=g) * 3 + 0.2,
                  f"model.layers.{index}.self_attn.o_proj": s_o,
                  f"model.layers.{index}.mlp.gate_up_proj": torch.rand(layer.mlp.gate_up_proj.in_features, generator=g) * 3 + 0.2,
                  f"model.layers.{index}.mlp.down_proj": torch.rand(layer.mlp.down_proj.in_features, generator=g) * 3 + 0.2}
        fold_scales(model, index, scales)
    after = _logits(llm)
    assert torch.allclose(before, after, atol=1e-4), (before - after).abs().max()


def test_searched_scales_lower_the_output_error_against_rtn():
    """Inputs with a few large channels (what AWQ is for): the scaled, quantized weight's error
    on those inputs is below RTN's, and alpha = 0 (RTN) is never beaten by a worse pick."""
    g = torch.Generator().manual_seed(5)
    k, n, group = 128, 48, 32
    channel = torch.ones(k)
    channel[torch.randperm(k, generator=g)[:6]] = 20.0  # salient input channels
    x = torch.randn(512, k, generator=g) * channel
    w = torch.randn(n, k, generator=g) * 0.05
    h = x.T @ x
    scheme = WeightScheme(4, group)
    s, alpha, ratio = search_scale(w, h, x.abs().mean(dim=0), AwqConfig(scheme))
    assert alpha > 0 and ratio < 0.9
    q = rtn_int4(w * s[None, :], group, torch.float32).dequantize() / s[None, :]
    err = lambda wq: ((wq - w) @ x.T).norm()
    assert err(q) < 0.95 * err(rtn_int4(w, group, torch.float32).dequantize())
    # The clip search on top lowers it further (or keeps it: 1.0 is on its grid).
    clipped = clipped_rtn_int4(w * s[None, :], h / (s[:, None] * s[None, :]), group,
                               AwqConfig(scheme).shrinks, torch.float32).dequantize() / s[None, :]
    assert err(clipped) <= err(q) * 1.0001


def test_awq_lowers_a_tiny_models_quantization_error(tmp_path):
    """On a tiny model, calibrated on random tokens: AWQ (scales + clip) then int4 leaves the
    logits closer to the float model's than RTN int4 does."""
    from rooflm.quantize.quantize import collect_hessians, quantize_linear
    src = _salient_model(tmp_path)
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 250, (64,), generator=g).tolist() for _ in range(6)]
    scheme = WeightScheme(4, 32)
    reference = _logits(_llm(src))

    def quantized_logits(method: str) -> torch.Tensor:
        llm = _llm(src)
        model = llm.engine.runner.model
        means: dict = {}
        hessians = collect_hessians(llm, windows, means)
        if method == "awq":
            apply_awq(model, hessians, means, AwqConfig(scheme))
        from rooflm.quantize.quantize import decoder_linears
        with torch.no_grad():
            for name, linear in decoder_linears(model).items():
                q = quantize_linear(linear.weight.detach().float(), scheme, method, hessians[name])
                linear.weight.copy_(q.dequantize())
        return _logits(llm)

    err_rtn = (quantized_logits("rtn") - reference).norm()
    err_awq = (quantized_logits("awq") - reference).norm()
    assert err_awq < err_rtn, (err_awq, err_rtn)


@pytest.mark.parametrize("method", ["awq", "awq+gptq"])
def test_awq_checkpoint_loads_with_the_folded_norms(tmp_path, method):
    """`rooflm quantize --method awq|awq+gptq`'s steps on a tiny model: the written GPTQ v1
    directory loads to the folded norms and the scaled weights' quantized values; AWQ's logits
    are closer to the float model's than RTN's checkpoint."""
    from rooflm.quantize.quantize import collect_hessians, quantize_linear, quantized_state_dict, write_checkpoint
    src = _salient_model(tmp_path)
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 250, (64,), generator=g).tolist() for _ in range(6)]
    scheme = WeightScheme(4, 32)
    config = json.load(open(os.path.join(src, "config.json")))
    written = {}
    for m in ("rtn", method):
        llm = _llm(src)
        model = llm.engine.runner.model
        means: dict = {}
        hessians = collect_hessians(llm, windows, means)
        if m != "rtn":
            report = apply_awq(model, hessians, means, AwqConfig(scheme))
            assert len(report.alpha) == 4 * len(model.model.layers)
            scaled = model
        tensors = quantized_state_dict(model, scheme, m, hessians, torch.float32)
        written[m] = tmp_path / m
        write_checkpoint(str(written[m]), config, tensors, scheme, torch.float32)
    loaded = _llm(str(written[method]))
    lmodel = loaded.engine.runner.model
    name = "model.layers.1.mlp.gate_up_proj"
    assert torch.equal(lmodel.model.layers[1].post_attention_layernorm.weight,
                       scaled.model.layers[1].post_attention_layernorm.weight)
    expected = quantize_linear(scaled.get_submodule(name).weight.detach().float(), scheme, method, hessians[name])
    assert torch.equal(lmodel.get_submodule(name).weight, expected.dequantize())
    if method == "awq":
        reference = _logits(_llm(src))
        err = {m: (_logits(_llm(str(d))) - reference).norm() for m, d in written.items()}
        assert err["awq"] < err["rtn"], err


def test_gptq_scored_search_is_best_for_gptq_on_its_grid():
    """score_with="gptq" picks, on the same alpha grid, a scale whose GPTQ output error is no
    larger than that of the scale the RTN-scored search picks, once both are quantized by GPTQ."""
    from rooflm.quantize.awq import output_error
    from rooflm.quantize.gptq import gptq_quantize
    g = torch.Generator().manual_seed(7)
    k, n, group = 128, 32, 32
    channel = torch.ones(k)
    channel[torch.randperm(k, generator=g)[:5]] = 15.0
    x = torch.randn(384, k, generator=g) * channel
    w = torch.randn(n, k, generator=g) * 0.05
    h = x.T @ x
    scheme = WeightScheme(4, group)

    def gptq_error(s):
        q = gptq_quantize(w * s[None, :], h / (s[:, None] * s[None, :]), 4, group, scale_dtype=torch.float32)
        return output_error(q.dequantize() / s[None, :] - w, h)
    grid = tuple(i / 8 for i in range(8))  # a coarser grid than the default 20: seconds, not tens
    s_rtn, _, _ = search_scale(w, h, x.abs().mean(dim=0), AwqConfig(scheme, alphas=grid))
    s_gptq, _, ratio = search_scale(w, h, x.abs().mean(dim=0), AwqConfig(scheme, alphas=grid, score_with="gptq"))
    assert gptq_error(s_gptq) <= gptq_error(s_rtn) * (1 + 1e-6)
    assert ratio <= 1.0
