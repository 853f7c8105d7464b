"""The mma.sync W4A16 kernel (rooflm/kernels/w4a16_mma.py, csrc/w4a16_mma.cu) against
dequantize-then-fp32, and its dispatch from w4a16_linear."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
import rooflm.envs as envs
from rooflm.kernels import w4a16_mma as mm
from rooflm.kernels.w4a16 import pack_int4, w4a16_linear, w4a16_linear_ref


def _w4(n, k, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (0.01 + 0.02 * torch.rand(k // group, n, generator=g)).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).to(dtype)
    x = torch.randn(1, k, generator=g)
    return pack_int4(codes, group).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), x


def test_shared_memory_counts_codes_and_scales_per_warp_and_stage():
    assert mm.shared_bytes(mm.MmaConfig(8, 1, 1, 0), 128) == 0
    # per warp and stage: 2 rows x 2 spans x 32 lanes code chunks + 8 scale chunks, 16 bytes each
    assert mm.shared_bytes(mm.MmaConfig(8, 1, 1, 4), 128) == 8 * 4 * (2 * 2 * 32 + 8) * 16
    assert mm.shared_bytes(mm.MmaConfig(4, 1, 2, 3), 64) == 4 * 3 * (4 * 1 * 32 + 16) * 16


def test_pick_config_reads_the_table_before_the_heuristic():
    table = {"GPU X": {"w4a16_mma": [{"n": 64, "k": 256, "m": 1, "group": 64,
                                      "config": {"warps": 2, "depth": 3, "tiles": 1, "stages": 4}}]}}
    from rooflm.kernels import tuned_configs
    assert tuned_configs.lookup("w4a16_mma", "GPU X", 64, 256, 1, 64, table=table) == table["GPU X"]["w4a16_mma"][0]["config"]
    mm.pick_config.cache_clear()
    assert mm.pick_config(1, 28672, 4096, 128, None) == mm.MmaConfig(4, 1, 2)  # >= 1024 tiles: two a warp
    assert mm.pick_config(1, 4096, 14336, 128, None) == mm.MmaConfig(8, 1, 1)
    assert mm.pick_config(1, 6144, 4096, 128, None) == mm.MmaConfig(4, 2, 1)


def test_the_kernel_declines_what_it_cannot_take():
    qw, s, z, x = _w4(32, 256, 64, torch.float32)  # fp32 scales and zeros
    x = x.to(DEVICE)
    if DEVICE == "cpu":
        assert not mm.supported(x.to(torch.bfloat16), qw.cpu(), s, z, 256, 64)
    assert not mm.supported(x.float(), qw, s, z, 256, 64)  # fp32 activations: Triton's kernels
    assert not mm.supported(torch.zeros(9, 256, dtype=torch.bfloat16, device=DEVICE), qw, s.bfloat16(), z.bfloat16(),
                            256, 64)  # M > 8
    # GGUF keeps fp16/fp32 scales exact: Triton reads them as they are
    assert not mm.supported(x.to(torch.bfloat16), qw, s, z, 256, 64)


CONFIGS = [mm.MmaConfig(4, 2, 1, 0), mm.MmaConfig(8, 1, 2, 0), mm.MmaConfig(2, 4, 1, 0),
           mm.MmaConfig(4, 1, 1, 3), mm.MmaConfig(8, 1, 2, 4), mm.MmaConfig(1, 1, 2, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "w{}d{}t{}s{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k,group", [(48, 256, 64), (96, 1024, 128), (6144, 4096, 128), (40, 640, 64)])
def test_mma_kernel_matches_the_reference(config, dtype, m, n, k, group):
    qw, s, z, _ = _w4(n, k, group, dtype, seed=m)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    for pdl in (False, True):
        out = mm.w4a16_mma(x, qw, s, z, group, config, pdl=pdl)
        assert_close(out, w4a16_linear_ref(x, qw, s, z, group), dtype, f"{config} pdl={pdl}")


@pytest.mark.gpu
def test_mma_kernel_replays_in_a_cuda_graph_and_is_deterministic():
    qw, s, z, _ = _w4(4096, 4096, 128, torch.bfloat16)
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    cfg = mm.MmaConfig(8, 1, 1, 4)
    eager = mm.w4a16_mma(x, qw, s, z, 128, cfg, pdl=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm.w4a16_mma(x, qw, s, z, 128, cfg, pdl=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mm.w4a16_mma(x, qw, s, z, 128, cfg, pdl=True))  # fixed order: same bits
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 9])
def test_w4a16_linear_takes_the_mma_kernel_up_to_m8(m, monkeypatch):
    qw, s, z, _ = _w4(256, 512, 128, torch.bfloat16)
    x = torch.randn(m, 512, device=DEVICE, dtype=torch.bfloat16)
    calls = []
    real = mm.w4a16_mma
    monkeypatch.setattr(mm, "w4a16_mma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = w4a16_linear(x, qw, s, z, 128)
    assert len(calls) == (1 if m <= 8 and envs.cached.ROOFLM_W4_MMA else 0)
    assert_close(out, w4a16_linear_ref(x, qw, s, z, 128), torch.bfloat16)


def test_only_a_quantized_gate_up_takes_the_fused_silu_mul():
    from rooflm.layers.linear import FusedLinear
    from rooflm.quant.linear_method import QuantizedLinearMethod
    x = torch.randn(1, 32)
    assert FusedLinear(32, {"gate": 16, "up": 16}).forward_silu_mul(x) is None  # float weight
    assert QuantizedLinearMethod().gate_up_silu_mul(x) is None  # a method without the kernel
    qkv = FusedLinear(32, {"q": 16, "k": 8, "v": 8})
    qkv.quant = QuantizedLinearMethod()
    assert qkv.forward_silu_mul(x) is None  # not a gate/up pair


GATED_CONFIGS = [mm.MmaConfig(4, 2, 1, 0), mm.MmaConfig(8, 1, 2, 0), mm.MmaConfig(4, 1, 1, 3),
                 mm.MmaConfig(8, 1, 2, 4), mm.MmaConfig(1, 1, 2, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GATED_CONFIGS, ids=lambda c: "w{}d{}t{}s{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("inter,k,group", [(32, 256, 64), (96, 1024, 128), (14336, 4096, 128)])
def test_gated_kernel_is_silu_mul_of_the_gate_up_reference(config, dtype, m, inter, k, group):
    from rooflm.kernels.silu_mul import silu_mul
    qw, s, z, _ = _w4(2 * inter, k, group, dtype, seed=m)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    ref = silu_mul(w4a16_linear_ref(x, qw, s, z, group))
    for pdl in (False, True):
        out = mm.w4a16_mma(x, qw, s, z, group, config, pdl=pdl, gated=True)
        assert out.shape == (m, inter)
        assert_close(out, ref, dtype, f"{config} pdl={pdl}")


@pytest.mark.gpu
def test_gate_up_silu_mul_declines_what_the_gated_kernel_cannot_take():
    from rooflm.kernels.silu_mul import silu_mul
    from rooflm.kernels.w4a16 import w4a16_gate_up_silu_mul
    qw, s, z, _ = _w4(512, 1024, 128, torch.bfloat16)
    assert w4a16_gate_up_silu_mul(torch.randn(9, 1024, device=DEVICE, dtype=torch.bfloat16), qw, s, z, 128) is None
    assert w4a16_gate_up_silu_mul(torch.randn(2, 1024, device=DEVICE), qw, s, z, 128) is None  # fp32 x
    x = torch.randn(2, 1024, device=DEVICE, dtype=torch.bfloat16)
    out = w4a16_gate_up_silu_mul(x, qw, s, z, 128)
    if envs.cached.ROOFLM_W4_SILU_MUL and envs.cached.ROOFLM_W4_MMA:
        assert_close(out, silu_mul(w4a16_linear_ref(x, qw, s, z, 128)), torch.bfloat16)


def test_llama_mlp_takes_the_fused_silu_mul_when_gate_up_offers_it():
    from rooflm.config import ModelConfig
    from rooflm.layers.activation import silu_and_mul_torch
    from rooflm.model.decoder import GatedMLP
    from rooflm.model.spec import llama_spec
    from rooflm.quant.linear_method import QuantizedLinearMethod
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=120, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    mlp = GatedMLP(cfg, llama_spec(cfg))
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 16)
    plain = mlp(x)
    assert torch.allclose(plain, mlp.down_proj(silu_and_mul_torch(mlp.gate_up_proj(x))))

    class Fused(QuantizedLinearMethod):  # stands in for W4A16Linear: the same product, fused
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, x):
            raise AssertionError("the MLP should not run gate_up unfused when the fused op answers")

        def gate_up_silu_mul(self, x):
            return silu_and_mul_torch(x @ self.weight.T)

    mlp.gate_up_proj.quant = Fused(mlp.gate_up_proj.weight.detach().clone())
    assert torch.allclose(mlp(x), plain)


FOLD_CONFIGS = [mm.MmaConfig(4, 2, 1, 0), mm.MmaConfig(8, 1, 1, 0), mm.MmaConfig(4, 1, 2, 3), mm.MmaConfig(8, 1, 2, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", FOLD_CONFIGS, ids=lambda c: "w{}d{}t{}s{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(64, 256, 64), (6144, 4096, 128), (2 * 14336, 4096, 128)])
def test_norm_prologue_is_the_linear_of_rmsnorm(config, dtype, n, k, group):
    from rooflm.kernels.rmsnorm import rmsnorm_ref
    from rooflm.kernels.silu_mul import silu_mul
    qw, s, z, _ = _w4(n, k, group, dtype, seed=n)
    h = torch.randn(1, k, device=DEVICE, dtype=dtype) * 3
    w = torch.randn(k, device=DEVICE, dtype=dtype)
    ref = w4a16_linear_ref(rmsnorm_ref(h, w, 1e-5), qw, s, z, group)
    for pdl in (False, True):
        assert_close(mm.w4a16_mma(h, qw, s, z, group, config, pdl=pdl, norm_weight=w, eps=1e-5), ref, dtype,
                     f"norm {config} pdl={pdl}")
    assert_close(mm.w4a16_mma(h, qw, s, z, group, config, gated=True, norm_weight=w, eps=1e-5), silu_mul(ref),
                 dtype, f"norm + gated {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", FOLD_CONFIGS, ids=lambda c: "w{}d{}t{}s{}".format(*c))
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (1, 4096, 14336), (5, 4096, 4096)])
def test_residual_epilogue_adds_after_rounding(config, m, n, k):
    qw, s, z, _ = _w4(n, k, 128 if k % 128 == 0 else 64, torch.bfloat16, seed=k)
    group = 128 if k % 128 == 0 else 64
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    r = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16) * 4
    ref = w4a16_linear_ref(x, qw, s, z, group) + r  # bf16 + bf16: the product rounded, then the sum
    out = mm.w4a16_mma(x, qw, s, z, group, config, pdl=True, residual=r)
    assert_close(out, ref, torch.bfloat16, f"residual {config}")


@pytest.mark.gpu
def test_folded_declines_what_the_kernel_cannot_take():
    from rooflm.kernels.w4a16 import w4a16_folded
    qw, s, z, _ = _w4(512, 1024, 128, torch.bfloat16)
    w = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16)
    assert w4a16_folded(torch.randn(2, 1024, device=DEVICE, dtype=torch.bfloat16), qw, s, z, 128, norm_weight=w) is None
    assert w4a16_folded(torch.randn(1, 1024, device=DEVICE, dtype=torch.bfloat16), qw, s, z, 128,
                        norm_weight=w.float()) is None  # the norm weight in another dtype
    x = torch.randn(1, 1024, device=DEVICE, dtype=torch.bfloat16)
    out = w4a16_folded(x, qw, s, z, 128, norm_weight=w, gated=True)
    if envs.cached.ROOFLM_W4_FOLD and envs.cached.ROOFLM_W4_MMA and envs.cached.ROOFLM_W4_SILU_MUL:
        assert out is not None and out.shape == (1, 256)


def test_shared_memory_holds_the_normalized_row_after_the_stages():
    assert mm.shared_bytes(mm.MmaConfig(8, 1, 1, 0), 128, 4096) == 2 * 4096
    assert mm.shared_bytes(mm.MmaConfig(8, 1, 1, 4), 128, 4096) == 8 * 4 * (2 * 2 * 32 + 8) * 16 + 2 * 4096


def test_llama_layer_folds_norms_and_residual_adds_into_quantized_linears():
    """The one-token layer with linears whose method folds (as W4A16Linear's mma kernel does) gives
    the unfolded layer's result, and falls back whole where qkv's method cannot fold."""
    from rooflm.config import ModelConfig
    from rooflm.model.decoder import DecoderLayer
    from rooflm.model.spec import llama_spec
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=120, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    layer = DecoderLayer(cfg, llama_spec(cfg), None, None, None)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    layer.self_attn.attend = lambda positions, qkv, kv_cache, meta: torch.tanh(qkv[:, :16])  # attention's stand-in
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    out, res = layer(None, x, residual, None, None)
    plain = out + res  # the residual stream after the layer

    from tests.models.test_decoder_paths import Folding  # W4A16Linear's contract, in torch

    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    for lin in linears:
        lin.quant = Folding(lin.weight.detach().clone())
    h, none = layer(None, x, residual, None, None)
    assert none is None and torch.allclose(h, plain, atol=1e-5)
    assert [lin.quant.calls for lin in linears] == [[(True, False, False)], [(False, True, False)],
                                                    [(True, False, True)], [(False, True, False)]]
    layer.self_attn.qkv_proj.quant.folded = lambda *a, **k: None  # qkv cannot: the unfolded layer runs
    out2, res2 = layer(None, x, residual, None, None)
    assert res2 is not None and torch.allclose(out2 + res2, plain, atol=1e-5)
