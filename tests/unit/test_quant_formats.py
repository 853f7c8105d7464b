"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints (rooflm/quant/formats.py,
checkpoint.py), RTN and GPTQ quantization.

The layouts are checked against the formats' published descriptions, written out here a second
time in plain loops over Python integers (not through formats.py's packers): GPTQ v1
(AutoGPTQ: qweight packed along K, qzeros along N and stored minus one), AWQ GEMM (AutoAWQ:
packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7) and compressed-tensors pack-quantized
(compressed_tensors.pack_to_int32: signed values plus 2^(bits-1), packed along K from bit 0;
asymmetric zero points packed the same way along N; llm-compressor does not install here).
"""

import json
import os

import pytest
import torch

from rooflm.errors import ModelLoadError
from rooflm.quant import formats
from rooflm.quant.checkpoint import QuantScheme, group_quantized, parse_quant_config
from rooflm.quantize.gptq import gptq_quantize
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


def _spec_pack_ct(rows, bits):
    """rows [R][C] of signed values -> int32 [R][ceil(C * bits / 32)] as pack_to_int32 (packed_dim 1)."""
    per, offset = 32 // bits, 1 << (bits - 1)
    out = []
    for r in rows:
        padded = [v + offset for v in r] + [0] * (-len(r) % per)
        out.append([_int32(sum(padded[w * per + i] << (bits * i) for i in range(per)))
                    for w in range(len(padded) // per)])
    return torch.tensor(out, dtype=torch.int32)


def _spec_pack_ct_zero_points(zp, bits):
    """zero points [N][G] signed -> int32 [ceil(N * bits / 32)][G]: pack_to_int32 with packed_dim 0."""
    columns = [list(c) for c in zip(*zp)]  # [G][N]
    return _spec_pack_ct(columns, bits).T.contiguous()


def _ct_tensors(q, scales, zp, bits, packed_zero=True):
    """The tensors of one pack-quantized linear from signed codes q [N][K], scales [N, G], zero
    points [N][G] (None: symmetric)."""
    n, k = len(q), len(q[0])
    t = {"weight_packed": _spec_pack_ct(q, bits), "weight_scale": scales.contiguous(),
         "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if zp is not None:
        t["weight_zero_point"] = (_spec_pack_ct_zero_points(zp, bits) if packed_zero
                                  else torch.tensor(zp, dtype=torch.int8))
    return t


@pytest.mark.parametrize("bits,group,sym,packed_zero,actorder", [
    (4, 32, True, True, False), (4, 32, False, True, False), (4, -1, False, True, False),
    (4, 16, False, False, False), (4, 16, True, True, True), (8, -1, True, True, False),
    (8, -1, False, True, False), (8, 32, False, True, False)],
    ids=lambda v: str(v))
def test_compressed_tensors_pack_quantized_decodes_per_spec(bits, group, sym, packed_zero, actorder):
    g = torch.Generator().manual_seed(bits * 100 + group)
    n, k = 12, 64  # N not a multiple of 8: the packed zero points are padded
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    gs = k if group == -1 else group
    q = torch.randint(lo, hi + 1, (n, k), generator=g)
    scales = (torch.rand(n, k // gs, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zp = None if sym else torch.randint(lo, hi + 1, (n, k // gs), generator=g)
    g_idx = None
    group_of = torch.arange(k) // gs
    if actorder:  # weight_g_idx: inputs assigned to groups out of order
        group_of = group_of[torch.randperm(k, generator=g)]
        g_idx = group_of.to(torch.int32)
    t = _ct_tensors(q.tolist(), scales, None if zp is None else zp.tolist(), bits, packed_zero)
    w = formats.from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                        t.get("weight_zero_point"), g_idx, bits, group)
    expected = torch.empty(n, k)
    for kk in range(k):
        grp = int(group_of[kk])
        z = 0 if zp is None else zp[:, grp]
        expected[:, kk] = scales[:, grp].float() * (q[:, kk] - z).float()
    assert torch.equal(w.dequantize(), expected)
    assert (getattr(w, "perm", None) is not None) == actorder
    assert isinstance(w, formats.ChannelWeight if bits == 8 and group == -1 else formats.GroupWeight)


def test_compressed_tensors_configs_parse_and_unsupported_ones_fail_naming_what():
    def ct(weights, fmt="pack-quantized", acts=None):
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}}
    w4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    assert parse_quant_config(ct(w4), "c") == QuantScheme("ct-packed", 4, 128, False, True)
    assert parse_quant_config(ct(dict(w4, symmetric=False, actorder="group")), "c") == \
        QuantScheme("ct-packed", 4, 128, True, False)
    assert parse_quant_config(ct(dict(w4, strategy="channel", num_bits=8)), "c") == QuantScheme("ct-packed", 8, -1)
    with pytest.raises(ModelLoadError, match="'int-quantized'"):
        parse_quant_config(ct(dict(w4, num_bits=8), fmt="int-quantized"), "c")
    with pytest.raises(ModelLoadError, match="strategy 'tensor'"):
        parse_quant_config(ct(dict(w4, strategy="tensor")), "c")
    with pytest.raises(ModelLoadError, match="input activations"):
        parse_quant_config(ct(w4, acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "c")


def test_compressed_tensors_grouping_checks_symmetric_zero_points():
    q = [[(i * 7 + j) % 16 - 8 for j in range(64)] for i in range(8)]
    t = _ct_tensors(q, torch.full((8, 2), 0.01), None, 4)
    zeros = _spec_pack_ct_zero_points([[0, 0]] * 8, 4)  # written by an older symmetric writer: zero
    stream = [("a.q_proj.weight_zero_point", zeros, "f")] + [(f"a.q_proj.{p}", v, "f") for p, v in t.items()]
    out = dict((n, w) for n, w, _ in group_quantized(iter(stream), QuantScheme("ct-packed", 4, 32)))
    assert set(out) == {"a.q_proj.weight"}
    assert torch.equal(out["a.q_proj.weight"].dequantize(), torch.tensor(q).float() * 0.01)
    bad = [("a.q_proj.weight_zero_point", _spec_pack_ct_zero_points([[1, 0]] * 8, 4), "f")]
    with pytest.raises(ModelLoadError, match="non-zero zero points"):
        list(group_quantized(iter(bad), QuantScheme("ct-packed", 4, 32)))
    with pytest.raises(ModelLoadError, match="lacks weight_zero_point"):
        list(group_quantized(iter([(f"a.q_proj.{p}", v, "f") for p, v in t.items()]),
                             QuantScheme("ct-packed", 4, 32, sym=False)))


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
            if layout == "ct":  # compressed-tensors pack-quantized, written from the spec (signed codes)
                offset = 1 << (scheme.bits - 1)
                signed = q.codes.to(torch.int32) - (0 if scheme.bits == 8 else offset)
                if scheme.bits == 8:  # rtn_int8: symmetric, one scale a row
                    parts = _ct_tensors(signed.tolist(), q.scales[:, None].to(torch.bfloat16), None, 8)
                    q = formats.ChannelWeight(q.codes, q.scales.to(torch.bfloat16), q.zeros)
                else:  # rtn_int4: asymmetric groups, zero points packed along N
                    zp = (q.zeros.float().round().to(torch.int32) - offset).T
                    parts = _ct_tensors(signed.tolist(), q.scales.T.to(torch.bfloat16), zp.tolist(), 4)
                    q = formats.GroupWeight(q.codes, q.scales.to(torch.bfloat16), q.zeros, q.group_size)
            else:
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
    if layout == "ct":
        weights = {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.bits == 8,
                   "strategy": "channel" if scheme.bits == 8 else "group", "dynamic": False,
                   "group_size": None if scheme.bits == 8 else scheme.group_size, "actorder": None}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                    "input_activations": None}},
                                      "ignore": ["lm_head"], "quantization_status": "compressed"}
    elif layout == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": scheme.group_size,
                                      "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
                                      "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return reference, cfg


@pytest.mark.parametrize("layout,scheme", [("gptq", "int4-g32"), ("awq", "int4-g32"), ("gptq", "int8"),
                                           ("ct", "int4-g32"), ("ct", "int8")])
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
    from rooflm.quantize.quantize import collect_hessians, quantized_state_dict, write_checkpoint
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
