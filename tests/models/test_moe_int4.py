"""int4 weight-only MoE checkpoints (GPTQ with and without act-order, AWQ, compressed-tensors
pack-quantized) in the Qwen3-30B-A3B-GPTQ-Int4 layout: each expert's qweight / qzeros / scales /
g_idx under mlp.experts.{e}.{gate,up,down}_proj, the router float. A tiny random Qwen3-MoE is
quantized here (round to nearest, group 32) and written in each layout; its tokens and logprobs
equal those of a float checkpoint holding the dequantized values."""

import json
import os

import pytest
import torch

from rooflm.layers.moe import MoeConfig, SparseMoeBlock
from rooflm.llm import LLM
from rooflm.quant import formats
from rooflm.quant.rtn import WeightScheme, rtn_int4
from rooflm.sampling_params import SamplingParams
from tests.models.test_moe_parity import make_tiny_moe
from tests.unit.test_quant_formats import _write_quantized_copy

PROMPTS = [[5, 9, 17, 33, 2, 71], list(range(40, 52))]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path, _ = make_tiny_moe(tmp_path_factory.mktemp("moe"), "qwen3_moe")
    return path


def _act_order_copy(src: str, dst: str) -> dict:
    """GPTQ with desc_act: every expert weight's inputs quantized in a random order (g_idx names
    each input's group), the other linears plain; returns the decoded float values."""
    from safetensors.torch import load_file, save_file
    gen = torch.Generator().manual_seed(3)
    out, reference = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if ".layers." in name and name.endswith("_proj.weight"):
            perm = torch.randperm(t.shape[1], generator=gen) if ".experts." in name else None
            q = rtn_int4(t if perm is None else t[:, perm], 32)
            q = formats.GroupWeight(q.codes, q.scales, q.zeros, q.group_size, perm=perm)
            out.update({f"{name[:-len('.weight')]}.{p}": v for p, v in formats.to_gptq(q, 4).items()})
            reference[name] = q.dequantize()
        else:
            out[name] = reference[name] = t
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                  "sym": False, "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return reference, cfg


def _generate(path):
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    return llm, llm.generate(PROMPTS, params)


def _write_reference(reference: dict, cfg: dict, ref_dir):
    """The decoded (float) tensors of a quantized copy as a plain checkpoint: its reference."""
    from safetensors.torch import save_file
    os.makedirs(ref_dir)
    save_file({k: v.contiguous() for k, v in reference.items()}, str(ref_dir / "model.safetensors"))
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    with open(ref_dir / "config.json", "w") as f:
        json.dump(cfg, f)
    return ref_dir

@pytest.mark.parametrize("layout", ["gptq-act-order", "awq", "ct"])
def test_int4_moe_checkpoint_runs_as_its_dequantized_experts(moe_dir, tmp_path, layout):
    if layout == "gptq-act-order":
        reference, cfg = _act_order_copy(moe_dir, str(tmp_path / "q"))
    else:
        reference, cfg = _write_quantized_copy(moe_dir, str(tmp_path / "q"), layout, WeightScheme.parse("int4-g32"))
    experts = [n for n in reference if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 3  # two sparse layers, 4 experts, gate / up / down: all quantized
    ref_dir = _write_reference(reference, cfg, tmp_path / "ref")
    (quant_llm, quant), (_, ref) = _generate(tmp_path / "q"), _generate(ref_dir)
    for a, b in zip(quant, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: round(v.logprob, 4) for t, v in x.items()} == {t: round(v.logprob, 4) for t, v in y.items()}
    # The experts hold the decoded values exactly (the router stayed float).
    block = quant_llm.engine.model.model.layers[2].mlp
    inter = block.cfg.intermediate_size
    torch.testing.assert_close(block.experts.w13[3, inter:], reference["model.layers.2.mlp.experts.3.up_proj.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(block.experts.w2[1], reference["model.layers.2.mlp.experts.1.down_proj.weight"],
                               rtol=0, atol=0)


def test_block_takes_quantized_expert_weights_under_expert_parallel_ranks():
    """Each rank's part of a quantized checkpoint: rank 1 of 2 (expert parallel) takes experts 2-3
    whole, a tensor-parallel rank the middle of each expert, both from the decoded values."""
    cfg = MoeConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    q = rtn_int4(w, 32)
    tp = type("TP", (), {"rank": 1, "size": 2})()
    ep_block, tp_block = SparseMoeBlock(cfg, tp=tp, expert_parallel=True), SparseMoeBlock(cfg, tp=tp)
    for block in (ep_block, tp_block):
        block.load_weight("experts.3.up_proj.weight", q)
    torch.testing.assert_close(ep_block.experts.w13[1, 32:], q.dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(tp_block.experts.w13[3, 16:], q.dequantize()[16:], rtol=0, atol=0)


def _int4_weights(cfg: MoeConfig, seed: int = 0, perm: bool = False):
    """Per-expert GroupWeights (group 32) of random experts, under the Hub's names."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for e in range(cfg.num_experts):
        for proj, shape in (("gate", (cfg.intermediate_size, cfg.hidden_size)),
                            ("up", (cfg.intermediate_size, cfg.hidden_size)),
                            ("down", (cfg.hidden_size, cfg.intermediate_size))):
            w = torch.randn(shape, generator=gen) * 0.2
            order = torch.randperm(shape[1], generator=gen) if perm else None
            q = rtn_int4(w if order is None else w[:, order], 32)
            weights[f"experts.{e}.{proj}_proj.weight"] = formats.GroupWeight(q.codes, q.scales.float(),
                                                                              q.zeros.float(), 32, perm=order)
    weights["gate.weight"] = torch.randn(cfg.num_experts, cfg.hidden_size, generator=gen)
    return weights


def test_int4_experts_stay_int4_where_the_fused_kernel_runs():
    """With the fused kernel (the interpreter here, CUDA in serving) the experts keep the codes: a
    quarter of the float bytes plus the group scales and zeros, and the block's output equals the
    float block holding the decoded values. Act-order weights are decoded instead."""
    from rooflm.kernels.fused_moe import fused_moe
    from rooflm.layers.kernels import Kernels

    cfg = MoeConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64, norm_topk_prob=True)
    weights = _int4_weights(cfg)
    int4_block, float_block = SparseMoeBlock(cfg, Kernels(fused_moe=fused_moe)), SparseMoeBlock(cfg)
    for name, w in weights.items():
        int4_block.load_weight(name, w)
        float_block.load_weight(name, w)  # the torch path: dequantized
    experts = int4_block.experts
    assert experts.int4_group == 32 and experts.quant_format == "int4" and experts.w13.numel() == 0
    assert float_block.experts.int4_group == 0 and float_block.experts.quant_format == ""
    assert experts.weight_count() == float_block.experts.weight_count() == 4 * 3 * 64 * 64
    # codes: half a byte a weight; scales and zeros: two fp32 values per 32 weights
    assert experts.stored_weight_bytes() == experts.weight_count() * (0.5 + 2 * 4 / 32)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(int4_block(x), float_block(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="already quantized"):
        experts.quantize_fp8()

    act_order = SparseMoeBlock(cfg, Kernels(fused_moe=fused_moe))
    for name, w in _int4_weights(cfg, perm=True).items():
        act_order.load_weight(name, w)
    assert act_order.experts.int4_group == 0 and act_order.experts.w13.numel() == 4 * 128 * 64


@pytest.mark.gpu
def test_int4_checkpoint_runs_int4_experts_on_cuda(moe_dir, tmp_path):
    """A GPTQ Qwen3-MoE on the GPU: the experts stay int4 (the fused kernel's W4A16 path), and the
    greedy tokens equal the float checkpoint of the decoded values (fp32, graphs on)."""
    reference, cfg = _write_quantized_copy(moe_dir, str(tmp_path / "q"), "gptq", WeightScheme.parse("int4-g32"))
    ref_dir = _write_reference(reference, cfg, tmp_path / "ref")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for path in (tmp_path / "q", ref_dir):
        llm = LLM(model=str(path), dtype="float32", device="cuda", max_num_seqs=8)
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
        if path == tmp_path / "q":
            assert llm.engine.model.model.layers[0].mlp.experts.quant_format == "int4"
        llm.engine.shutdown()
    assert outs[0] == outs[1]
