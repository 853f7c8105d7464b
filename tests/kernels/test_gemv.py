"""Batch-1 GEMV with fused norm / gate / residual (rooflm/kernels/gemv.py) against the unfused layers."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
from rooflm.kernels.gemv import GemvConfig, gemv, gemv_ref


def _inputs(n, k, dtype, gated=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * n if gated else n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    return x, w, g


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(64, 128), (40, 96), (7, 300)])
def test_gemv_plain_matches_linear(n, k, dtype):
    x, w, _ = _inputs(n, k, dtype)
    assert_close(gemv(x, w), gemv_ref(x, w), dtype)


@pytest.mark.parametrize("n,k", [(64, 128), (36, 200)])
def test_gemv_fused_norm_gate_residual_bias(n, k):
    dtype = torch.float16
    x, w, g = _inputs(n, k, dtype, gated=True)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(1, n, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    assert_close(gemv(x, w, norm_weight=norm_w, eps=1e-5, gated=True),
                 gemv_ref(x, w, norm_weight=norm_w, eps=1e-5, gated=True), dtype, "norm+gated")
    plain_w = w[:n]
    assert_close(gemv(x, plain_w, residual=res), gemv_ref(x, plain_w, residual=res), dtype, "residual")
    assert_close(gemv(x, plain_w, bias=bias, norm_weight=norm_w),
                 gemv_ref(x, plain_w, bias=bias, norm_weight=norm_w), dtype, "norm+bias")


@pytest.mark.parametrize("n,k", [(64, 128), (36, 200)])
def test_gemv_gated_gelu_tanh_with_an_fp32_one_plus_norm(n, k):
    """Gemma's MLP input: a (1 + w) norm's fp32 fused weight folded into the load of x, and
    gelu_tanh(gate) * up in the epilogue, against the unfused ops; and not SiLU's result."""
    dtype = torch.float16
    x, w, g = _inputs(n, k, dtype, gated=True, seed=3)
    x = 4 * x  # gates well into GELU's curve on both sides
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE)  # fp32, as OnePlusRMSNorm.fused_weight
    out = gemv(x, w, norm_weight=norm_w, eps=1e-6, gated=True, act="gelu_tanh")
    assert_close(out, gemv_ref(x, w, norm_weight=norm_w, eps=1e-6, gated=True, act="gelu_tanh"), dtype, "gelu")
    silu = gemv_ref(x, w, norm_weight=norm_w, eps=1e-6, gated=True)
    assert not torch.allclose(out.float(), silu.float(), atol=1e-2)
    with pytest.raises(ValueError, match="act"):
        gemv(x, w, gated=True, act="relu")


def test_gemv_out_dtype_and_inputs_untouched():
    x, w, g = _inputs(32, 64, torch.float16)
    res = torch.randn(1, 32, generator=g).to(torch.float16).to(DEVICE)
    x0, r0 = x.clone(), res.clone()
    out = gemv(x, w, residual=res, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (1, 32)
    assert torch.equal(x, x0) and torch.equal(res, r0)


def test_gemv_rejects_bad_shapes():
    x, w, _ = _inputs(16, 32, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        gemv(torch.randn(2, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 32\]"):
        gemv(x, torch.randn(16, 31, device=DEVICE))
    with pytest.raises(ValueError, match="gated"):
        gemv(x, w[:15], gated=True)
    with pytest.raises(ValueError, match="residual must have 16"):
        gemv(x, w, residual=torch.randn(1, 8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
                                       (4096, 14336, False), (128256, 4096, False), (1000, 1000, True)])
@pytest.mark.parametrize("config", [None, GemvConfig(16, 1024, 8, 3), GemvConfig(4, 256, 4, 1)])
def test_gemv_gpu_bf16_llama_shapes(n, k, gated, config):
    dtype = torch.bfloat16
    x, w, g = _inputs(n, k, dtype, gated=gated)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(1, n, generator=g).to(dtype).to(DEVICE)
    kwargs = dict(norm_weight=norm_w, eps=1e-5, gated=gated) if gated else dict(residual=res)
    assert_close(gemv(x, w, config=config, **kwargs), gemv_ref(x, w, **kwargs), dtype)


def test_tuned_gemv_table_lookup(tmp_path):
    """pick_config's table: an exact (n, k, gated) entry for the GPU, None for any other shape or GPU,
    and the shipped table's entries are valid launch shapes."""
    import json

    from rooflm.kernels.gemv import GemvConfig
    from rooflm.kernels.tuned_configs import GEMV_TABLE_PATH, lookup_gemv

    entry = {"n": 4096, "k": 3840, "gated": True, "config": {"block_n": 2, "block_k": 512, "num_warps": 4, "num_stages": 2}}
    path = tmp_path / "gemv.json"
    path.write_text(json.dumps({"GPU-X": {"gemv": [entry]}}))
    assert lookup_gemv("GPU-X", 4096, 3840, True, str(path)) == entry["config"]
    assert lookup_gemv("GPU-X", 4096, 3840, False, str(path)) is None  # the plain GEMV of that shape
    assert lookup_gemv("GPU-Y", 4096, 3840, True, str(path)) is None
    for gpu, kernels in json.loads(open(GEMV_TABLE_PATH).read()).items():
        for e in kernels["gemv"]:
            cfg = GemvConfig(**e["config"])
            assert cfg.block_k & (cfg.block_k - 1) == 0 and cfg.block_n & (cfg.block_n - 1) == 0, (gpu, e)
