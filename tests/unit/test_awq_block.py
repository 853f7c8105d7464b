"""AWQ with the block-output objective (rooflm/quantize/awq_block.py): the torch block forwards
reproduce the engine's, the fold leaves the float model unchanged, and the searched qkv / gate_up
scales give a smaller block output error than the per-linear objective's choices."""

import pytest
import torch

from rooflm.quantize.awq import AwqConfig, apply_awq
from rooflm.quantize.awq_block import apply_awq_block, attention_block, capture_block_inputs, mlp_block
from rooflm.quant.rtn import WeightScheme

WINDOWS = [torch.randint(3, 250, (48,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
SCHEME = WeightScheme(4, 32)
GRID = tuple(i / 8 for i in range(8))  # coarser than the default 20 alphas: a fast test


def _llm(path):
    from rooflm.llm import LLM
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, quantization="none",
               enable_prefix_caching=False)


def _block_outputs(llm, windows) -> dict:
    """(layer, "attention" | "mlp", window) -> o_proj's / down_proj's output in the engine."""
    from rooflm.sampling_params import SamplingParams
    model = llm.engine.runner.model
    outs: dict = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for kind, m in (("attention", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            handles.append(m.register_forward_hook(
                lambda mod, args, out, key=(i, kind): outs.setdefault(key, []).append(out.detach().clone())))
    try:
        for w in windows:
            llm.generate([w], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return outs


@pytest.mark.parametrize("family,attention", [("llama", "gqa"), ("qwen2", "mha")])
def test_block_forwards_match_the_engine(tmp_path, family, attention):
    """attention_block / mlp_block on the captured block inputs give what the engine's layers
    output for the same windows (GQA; Qwen2's qkv bias)."""
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, family, attention=attention)
    llm = _llm(src)
    inputs = capture_block_inputs(llm, WINDOWS[:2])
    outs = _block_outputs(llm, WINDOWS[:2])
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for w in range(2):
            assert inputs[i].attention[w].shape[0] == len(WINDOWS[w])
            a = attention_block(attn, inputs[i].attention[w], attn.qkv_proj.weight, attn.o_proj.weight)
            m = mlp_block(mlp, inputs[i].mlp[w], mlp.gate_up_proj.weight, mlp.down_proj.weight)
            torch.testing.assert_close(a, outs[(i, "attention")][w], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(m, outs[(i, "mlp")][w], rtol=1e-5, atol=1e-6)


def _salient_model(tmp_path) -> str:
    """A tiny Llama (GQA) with a few input channels 8x larger than the rest, as in trained LLMs
    (test_awq.py's model: random tiny weights have no outliers for AWQ to protect)."""
    from tests.models.tiny_models import make_tiny_model
    src, hf = make_tiny_model(tmp_path, "llama", attention="gqa")
    with torch.no_grad():
        for layer in hf.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40, 51]] *= 8.0
    hf.save_pretrained(src, safe_serialization=True)
    return src


def test_block_objective_beats_the_per_linear_choice_on_the_block_error(tmp_path):
    """Both searches pick the same o_proj/down_proj scales; for qkv/gate_up the block search's
    pick gives a block output error (every linear quantized as written) no larger than the
    per-linear pick's in every layer, and smaller in at least one. The float model's outputs do
    not change with the fold."""
    from rooflm.quantize.quantize import collect_hessians
    src = _salient_model(tmp_path)
    config = AwqConfig(SCHEME, alphas=GRID)
    quantize = config.quantizer()
    done = {}
    for objective in ("linear", "block"):
        llm = _llm(src)
        model = llm.engine.runner.model
        means: dict = {}
        hessians = collect_hessians(llm, WINDOWS, means)
        before = _block_outputs(llm, WINDOWS[:1])
        if objective == "block":
            report = apply_awq_block(model, hessians, means, capture_block_inputs(llm, WINDOWS), config)
        else:
            report = apply_awq(model, hessians, means, config)
        after = _block_outputs(llm, WINDOWS[:1])
        for key in before:
            torch.testing.assert_close(after[key][0], before[key][0], rtol=1e-4, atol=1e-5)
        # The scaled model's own block inputs (x / s after the fold into the norms).
        done[objective] = (model, hessians, capture_block_inputs(llm, WINDOWS), report)

    @torch.no_grad()
    def block_error(objective: str, i: int, kind: str) -> float:
        model, hessians, inputs, _ = done[objective]
        layer = model.model.layers[i]
        block, module, first, second = ((attention_block, layer.self_attn, "self_attn.qkv_proj", "self_attn.o_proj")
                                        if kind == "attention" else
                                        (mlp_block, layer.mlp, "mlp.gate_up_proj", "mlp.down_proj"))
        names = (f"model.layers.{i}.{first}", f"model.layers.{i}.{second}")
        w1, w2 = (model.get_submodule(n).weight for n in names)
        w1q, w2q = (quantize(model.get_submodule(n).weight.float(), hessians[n]) for n in names)
        return sum(float(((block(module, x, w1q, w2q) - block(module, x, w1, w2)) ** 2).sum())
                   for x in getattr(inputs[i], kind))

    strictly_better = 0
    for i in range(len(done["block"][0].model.layers)):
        for name in (f"model.layers.{i}.self_attn.o_proj", f"model.layers.{i}.mlp.down_proj"):
            assert done["block"][3].alpha[name] == done["linear"][3].alpha[name]
        for kind in ("attention", "mlp"):
            block, linear = block_error("block", i, kind), block_error("linear", i, kind)
            assert block <= linear * (1 + 1e-4), (i, kind, block, linear)
            strictly_better += block < linear * (1 - 1e-3)
    assert strictly_better > 0


def test_sequential_awq_searches_on_the_quantized_models_inputs(tmp_path):
    """awq_sequential.py: every linear ends quantized as returned (the model runs the written
    weights); layer 0's qkv scale, whose input no quantized linear precedes, is the one the
    float-input block search picks, and later scales are searched on other (quantized) inputs;
    the result is closer to the float model than RTN int4."""
    from rooflm.quantize.awq_sequential import sequential_awq_gptq
    from rooflm.quantize.quantize import collect_hessians, decoder_linears
    src = _salient_model(tmp_path)
    config = AwqConfig(SCHEME, alphas=GRID)
    total = sum(map(len, WINDOWS))

    llm = _llm(src)
    means: dict = {}
    hessians = collect_hessians(llm, WINDOWS, means)
    float_report = apply_awq_block(llm.engine.runner.model, hessians, means, capture_block_inputs(llm, WINDOWS[:2]),
                                   config)

    from rooflm.llm import LLM
    llm = LLM(model=src, dtype="float32", device="cpu", block_size=4, quantization="none",
              enable_prefix_caching=False, max_num_batched_tokens=total)
    means = {}
    hessians = collect_hessians(llm, WINDOWS, means)
    quantized, report = sequential_awq_gptq(llm, WINDOWS, config, hessians, means, block_windows=2)
    model = llm.engine.runner.model
    assert set(quantized) == set(decoder_linears(model)) == set(report.alpha)
    for name, q in quantized.items():
        assert torch.equal(model.get_submodule(name).weight, q.dequantize()), name
    first = "model.layers.0.self_attn.qkv_proj"
    assert report.alpha[first] == float_report.alpha[first]
    assert abs(report.error_ratio[first] - float_report.error_ratio[first]) < 1e-3
    later = [n for n in report.alpha if n != first and not n.endswith(("o_proj", "down_proj"))]
    assert any(abs(report.error_ratio[n] - float_report.error_ratio[n]) > 1e-3 for n in later)
    # The model as left (folded norms, written weights) is what the checkpoint holds: it must be
    # closer to the float model than RTN int4 (a missing norm fold would put it far off).
    rtn = _llm(src)
    from rooflm.quantize.quantize import quantize_linear
    with torch.no_grad():
        for name, linear in decoder_linears(rtn.engine.runner.model).items():
            linear.weight.copy_(quantize_linear(linear.weight.detach().float(), SCHEME, "rtn", None).dequantize())
    reference = _prompt_logprobs(_llm(src))
    err_awq = (_prompt_logprobs(llm) - reference).norm()
    err_rtn = (_prompt_logprobs(rtn) - reference).norm()
    assert err_awq < err_rtn, (err_awq, err_rtn)


def _prompt_logprobs(llm) -> torch.Tensor:
    """Each token's logprob after its prefix, over two held-out windows."""
    from rooflm.sampling_params import SamplingParams
    prompts = [torch.randint(3, 250, (48,), generator=torch.Generator().manual_seed(100 + i)).tolist() for i in range(2)]
    out = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    return torch.tensor([entry[token].logprob for o, p in zip(out, prompts)
                         for entry, token in zip(o.prompt_logprobs[1:], p[1:])])


@pytest.mark.parametrize("argv,message", [
    (["--method", "awq+gptq", "--awq-inputs", "quantized"], "needs --method awq\\+gptq --awq-objective block"),
    (["--method", "awq", "--awq-objective", "block", "--awq-inputs", "quantized"], "needs --method awq\\+gptq"),
    (["--method", "awq+gptq", "--awq-objective", "block", "--awq-inputs", "quantized", "--no-sequential"],
     "cannot be --no-sequential"),
    (["--method", "rtn", "--refit"], "--refit refits GPTQ's scales"),
])
def test_quantize_rejects_flag_combinations_it_cannot_honour(argv, message):
    """Checked before the model loads: each error names the flags."""
    import argparse
    from rooflm.quantize.commands import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["quantize", "--output", "unused"] + argv)
    with pytest.raises(ValueError, match=message):
        args.func(args)
