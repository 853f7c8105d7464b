"""GPTQ and AWQ checkpoints (rooflm/quant/formats.py, checkpoint.py), RTN and GPTQ quantization.

The layouts are checked against the formats' published descriptions, written out here a second
time in plain loops over Python integers (not through formats.py's packers): GPTQ v1
(AutoGPTQ: qweight packed along K, qzeros along N and stored minus one) and AWQ GEMM (AutoAWQ:
packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7).
"""

import json
import os

import pytest
import torch

from rooflm.model.errors import ModelLoadError
from rooflm.quant import formats
from rooflm.quant.checkpoint import QuantScheme, group_quantized, parse_quant_config
from rooflm.quant.gptq import gptq_quantize
from rooflm.quant.rtn import WeightScheme, rtn_int4, rtn_int8


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _spec_pack_gptq(codes, zeros, bits):
    """codes [K][N], zeros [G][N] (true zero points) as AutoGPTQ writes them."""
    per = 32 // bits
    k, n = len(codes), len(codes[0])
    qweight = [[_int32(sum(codes[i * per + j][c] << (bits * j) for j in range(per))) for c in range(n)]
               for i in range(k // per)]
    qzeros = [[_int32(sum(((zeros[g][c * per + j] - 1) & ((1 << bits) - 1)) << (bits * j) for j in range(per)))
               for c in range(n // per)] for g in range(len(zeros))]
    return torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32)


def _spec_pack_awq(rows):
    """rows [R][N] of 4-bit values -> [R][N/8], nibble i of each word holding column (0,2,4,6,1,3,5,7)[i]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return torch.tensor([[_int32(sum(r[c * 8 + order[i]] << (4 * i) for i in range(8))) for c in range(len(r) // 8)]
                         for r in rows], dtype=torch.int32)


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_int4_decodes_per_spec(desc_act):
    g = torch.Generator().manual_seed(1)
    k, n, gs = 64, 16, 16
    codes = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(1, 16, (k // gs, n), generator=g)
    scales = torch.rand(k // gs, n, generator=g).half() + 0.1
    g_idx = torch.arange(k) // gs
    if desc_act:  # act-order: inputs assigned to groups in a permuted order
        g_idx = g_idx[torch.randperm(k, generator=g)]
    qweight, qzeros = _spec_pack_gptq(codes.tolist(), zeros.tolist(), 4)
    w = formats.from_gptq(qweight, qzeros, scales, g_idx.int(), 4, gs).dequantize()
    expected = torch.empty(n, k)
    for kk in range(k):
        grp = int(g_idx[kk])
        expected[:, kk] = scales[grp].float() * (codes[kk] - zeros[grp]).float()
    assert torch.equal(w, expected)
    assert (formats.from_gptq(qweight, qzeros, scales, g_idx.int(), 4, gs).perm is not None) == desc_act


def test_gptq_int8_per_channel_and_awq_decode_per_spec():
    g = torch.Generator().manual_seed(2)
    k, n = 32, 8
    codes = torch.randint(0, 256, (k, n), generator=g)
    zeros = torch.randint(100, 156, (1, n), generator=g)
    scales = torch.rand(1, n, generator=g).half()
    qweight, qzeros = _spec_pack_gptq(codes.tolist(), zeros.tolist(), 8)
    w = formats.from_gptq(qweight, qzeros, scales, None, 8, -1).dequantize()
    assert torch.equal(w, (scales.float().T * (codes - zeros).float().T))

    k, n, gs = 64, 16, 32
    codes = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(0, 16, (k // gs, n), generator=g)
    scales = torch.rand(k // gs, n, generator=g).half()
    w = formats.from_awq(_spec_pack_awq(codes.tolist()), _spec_pack_awq(zeros.tolist()), scales, gs).dequantize()
    expected = (codes - zeros.repeat_interleave(gs, 0)).float() * scales.float().repeat_interleave(gs, 0)
    assert torch.equal(w, expected.T)


def test_writers_round_trip_through_readers():
    w = torch.randn(24, 96)
    q4 = rtn_int4(w, 32)
    assert torch.equal(formats.from_gptq(*[formats.to_gptq(q4, 4)[p] for p in ("qweight", "qzeros", "scales", "g_idx")],
                                         4, 32).dequantize(), q4.dequantize())
    awq = formats.to_awq(q4)
    assert torch.equal(formats.from_awq(awq["qweight"], awq["qzeros"], awq["scales"], 32).dequantize(), q4.dequantize())
    q8 = rtn_int8(w)
    t = formats.to_gptq(q8, 8)
    assert torch.equal(formats.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 8, -1).dequantize(),
                       q8.dequantize())


def test_rtn_error_bounds_and_short_last_group():
    w = torch.randn(8, 80)  # 80 = 2.5 groups of 32
    q = rtn_int4(w, 32)
    assert q.scales.shape == (3, 8)
    step = q.scales.float().T.repeat_interleave(32, dim=1)[:, :80]
    assert ((q.dequantize() - w).abs() <= 0.5 * step + 1e-3).all()
    q8 = rtn_int8(w)
    assert ((q8.dequantize() - w).abs() <= 0.5 * q8.scales.float()[:, None] + 1e-4).all()


def test_gptq_beats_rtn_on_its_own_loss():
    """||(W - Q) X|| with correlated inputs: GPTQ's error compensation must lower it vs RTN."""
    g = torch.Generator().manual_seed(3)
    k, n = 128, 32
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(512, k, generator=g) @ mix  # correlated features, like a layer's inputs
    w = torch.randn(n, k, generator=g)
    h = x.T @ x
    for bits, gs in ((4, 32), (8, -1)):
        rtn = rtn_int4(w, gs) if bits == 4 else rtn_int8(w)
        gptq = gptq_quantize(w, h, bits, gs)
        loss_rtn = ((rtn.dequantize() - w) @ x.T).norm()
        loss_gptq = ((gptq.dequantize() - w) @ x.T).norm()
        assert loss_gptq < 0.9 * loss_rtn, (bits, loss_gptq, loss_rtn)


def test_unsupported_schemes_fail_naming_the_scheme():
    with pytest.raises(ModelLoadError, match="'bitsandbytes'"):
        parse_quant_config({"quantization_config": {"quant_method": "bitsandbytes"}}, "config.json")
    with pytest.raises(ModelLoadError, match="bits=3"):
        parse_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 128}}, "c")
    with pytest.raises(ModelLoadError, match="gptq_v2"):
        parse_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                    "checkpoint_format": "gptq_v2"}}, "c")
    assert parse_quant_config({}, "c") is None
    assert parse_quant_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                       "zero_point": True, "version": "GEMM"}}, "c") == QuantScheme("awq", 4, 128)


def test_grouping_collects_parts_into_one_weight():
    q = rtn_int4(torch.randn(16, 64), 32)
    parts = formats.to_gptq(q, 4)
    stream = [("a.q_proj.qweight", parts["qweight"], "f"), ("a.norm.weight", torch.ones(3), "f"),
              ("a.q_proj.qzeros", parts["qzeros"], "f"), ("a.q_proj.scales", parts["scales"], "f"),
              ("a.q_proj.g_idx", parts["g_idx"], "f")]
    out = dict((n, t) for n, t, _ in group_quantized(iter(stream), QuantScheme("gptq", 4, 32)))
    assert set(out) == {"a.norm.weight", "a.q_proj.weight"}
    assert torch.equal(out["a.q_proj.weight"].dequantize(), q.dequantize())


def _write_quantized_copy(src: str, dst: str, layout: str, scheme: WeightScheme) -> dict:
    """A tiny HF checkpoint with its linears quantized (RTN) in `layout`; returns the float values
    each quantized weight decodes to, for the dequantize-then-float reference directory."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, reference = {}, {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            prefix = name[: -len(".weight")]
            q = rtn_int8(t) if scheme.bits == 8 else rtn_int4(t, scheme.group_size)
            parts = formats.to_awq(q) if layout == "awq" else formats.to_gptq(q, scheme.bits)
            out.update({f"{prefix}.{p}": v for p, v in parts.items()})
            reference[name] = q.dequantize()
        else:
            out[name] = t
            reference[name] = t
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if layout == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": scheme.group_size,
                                      "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
                                      "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return reference, cfg


@pytest.mark.parametrize("layout,scheme", [("gptq", "int4-g32"), ("awq", "int4-g32"), ("gptq", "int8")])
def test_quantized_checkpoint_loads_as_its_dequantized_values(tmp_path, layout, scheme):
    """The loader maps every part (fused q/k/v and gate/up included) to the right place: logits of
    the quantized directory equal those of a float directory holding the decoded values."""
    from safetensors.torch import save_file
    from rooflm.llm import LLM
    from rooflm.sampling_params import SamplingParams
    from tests.models.tiny_models import make_tiny_model

    src, _ = make_tiny_model(tmp_path, "qwen2")  # q/k/v biases ride along unquantized
    reference, cfg = _write_quantized_copy(src, str(tmp_path / "q"), layout, WeightScheme.parse(scheme))
    ref_dir = tmp_path / "ref"
    os.makedirs(ref_dir)
    save_file({k: v.contiguous() for k, v in reference.items()}, str(ref_dir / "model.safetensors"))
    cfg.pop("quantization_config")
    with open(ref_dir / "config.json", "w") as f:
        json.dump(cfg, f)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    prompts = [[5, 9, 17, 33, 2, 71]]
    outs = [LLM(model=str(d), dtype="float32", device="cpu", block_size=4).generate(prompts, params)[0]
            for d in (tmp_path / "q", ref_dir)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    for a, b in zip(outs[0].outputs[0].logprobs, outs[1].outputs[0].logprobs):
        assert {t: round(v.logprob, 4) for t, v in a.items()} == {t: round(v.logprob, 4) for t, v in b.items()}


def test_quantize_pipeline_writes_a_checkpoint_rooflm_loads(tmp_path):
    """rooflm quantize's steps on a tiny model: Hessians from calibration windows through the engine,
    GPTQ per fused linear, split back to HF names, GPTQ files that load to the same weights."""
    from safetensors.torch import load_file
    from rooflm.llm import LLM
    from rooflm.quant.quantize import collect_hessians, quantized_state_dict, write_checkpoint
    from tests.models.tiny_models import make_tiny_model

    src, _ = make_tiny_model(tmp_path, "qwen2")
    llm = LLM(model=src, dtype="float32", device="cpu", block_size=4, quantization="none",
              enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 250, (48,), generator=g).tolist() for _ in range(4)]
    hessians = collect_hessians(llm, windows)
    model = llm.engine.runner.model
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert hessians[qkv].shape == (64, 64) and torch.allclose(hessians[qkv], hessians[qkv].T)
    scheme = WeightScheme.parse("int4-g32")
    tensors = quantized_state_dict(model, scheme, "gptq", hessians, torch.float32)
    assert "model.layers.0.self_attn.k_proj.qweight" in tensors and "model.layers.0.self_attn.k_proj.bias" in tensors
    out = tmp_path / "out"
    write_checkpoint(str(out), json.load(open(os.path.join(src, "config.json"))), tensors, scheme, torch.float32)
    files = load_file(str(out / "model.safetensors"))
    decoded = [formats.from_gptq(*[files[f"model.layers.0.self_attn.{p}_proj.{part}"]
                                   for part in ("qweight", "qzeros", "scales", "g_idx")], 4, 32).dequantize()
               for p in "qkv"]
    loaded = LLM(model=str(out), dtype="float32", device="cpu", block_size=4).engine.runner.model
    weight = loaded.get_submodule(qkv).weight
    assert torch.allclose(weight, torch.cat(decoded), atol=0)
    # GPTQ's codes lower the layer's output error on the calibration inputs against RTN's.
    w = model.get_submodule(qkv).weight.detach()
    h = hessians[qkv]

    def loss(wq):
        d = wq - w
        return torch.einsum("nk,kl,nl->", d, h, d)
    assert loss(torch.cat(decoded)) < loss(rtn_int4(w, 32).dequantize())


def test_gptq_act_order_and_mse_write_g_idx_that_reads_back():
    g = torch.Generator().manual_seed(4)
    k, n = 128, 16
    x = torch.randn(256, k, generator=g) * torch.linspace(0.1, 3.0, k)  # uneven input scales
    w = torch.randn(n, k, generator=g)
    h = x.T @ x
    q = gptq_quantize(w, h, 4, 32, act_order=True, mse=True)
    assert q.perm is not None and not torch.equal(q.perm, torch.arange(k))
    t = formats.to_gptq(q, 4)
    assert not torch.equal(t["g_idx"], (torch.arange(k) // 32).int())
    back = formats.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32)
    assert torch.equal(back.dequantize(), q.dequantize())
    loss = lambda wq: ((wq - w) @ x.T).norm()
    assert loss(q.dequantize()) < loss(rtn_int4(w, 32).dequantize())
