"""RMSNorm / SiLU-mul with the FP8 quantization of their output fused in (kernels/norm_act_fp8.py).
On the GPU the codes and scales must be bit for bit what the path they replace writes (the Triton
RMSNorm or SiLU-mul kernel, then the quantizer), and close to the torch references' (whose
rsqrt / exp round differently from Triton's, so a code may sit one e4m3 step away). The kernels
run on sm89+ only (Triton's interpreter rounds to e4m3 wrongly, fp8_quant.py's header): off the
GPU the wrappers are the references, which the contract test checks."""

import pytest
import torch

from rooflm.kernels.fp8_quant import FP8_DTYPE
from rooflm.kernels.norm_act_fp8 import rmsnorm_fp8, rmsnorm_fp8_ref, silu_mul_fp8, silu_mul_fp8_ref
from tests.kernels.helpers import DEVICE, cuda_capability_at_least


def _sm89() -> bool:
    return cuda_capability_at_least((8, 9))


def _dequantized(q, s):
    return q.float() * s.float()


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype == FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b)


def _rows(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Rows spanning six decades: each row's own scale matters.
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    return x.to(dtype).to(DEVICE), g


def test_wrappers_keep_the_contract_off_the_gpu():
    """Shapes, dtypes, the residual's sum, and a static scale used for every row."""
    x, g = _rows(5, 64, torch.float32, 0)
    r = torch.randn(5, 64, generator=g).to(DEVICE)
    w = torch.rand(64, generator=g).to(DEVICE) + 0.5
    q, s, res = rmsnorm_fp8(x, w, 1e-6, r)
    assert q.dtype == FP8_DTYPE and q.shape == (5, 64) and s.shape == (5, 1) and s.dtype == torch.float32
    assert torch.equal(res, x + r)
    scale = torch.tensor([[0.05]], device=DEVICE)
    q2, s2 = rmsnorm_fp8(x, w, 1e-6, static_scale=scale)
    assert torch.equal(s2, scale.expand(5, 1))
    q3, s3 = silu_mul_fp8(torch.randn(3, 2 * 48, generator=g).to(DEVICE))
    assert q3.shape == (3, 48) and s3.shape == (3, 1)
    with pytest.raises(ValueError, match="one value"):
        silu_mul_fp8(torch.randn(3, 8).to(DEVICE), static_scale=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul_fp8(torch.randn(3, 7).to(DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        rmsnorm_fp8(x, w[:10], 1e-6)


def _unfused_triton(kind, x, static_scale, *args):
    """The ops the fused kernels replace, as the engine ran them: Triton RMSNorm / SiLU-mul, then
    the Triton per-token quantizer (or the static scale's divide)."""
    from rooflm.kernels.fp8_quant import per_token_fp8, static_fp8
    from rooflm.kernels.rmsnorm import rmsnorm
    from rooflm.kernels.silu_mul import silu_mul
    if kind == "silu_mul":
        y, extra = silu_mul(x), ()
    else:
        w, r = args
        out = rmsnorm(x, w, 1e-5, r)
        y, extra = (out, ()) if r is None else (out[0], (out[1],))
    if static_scale is None:
        return (*per_token_fp8(y), *extra)
    return (static_fp8(y, static_scale), static_scale.expand(y.shape[0], 1), *extra)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="the Triton e4m3 kernels run on sm89+ only")
@pytest.mark.parametrize("m,n", [(1, 4096), (37, 4096), (5, 100), (300, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_rmsnorm_fp8_writes_the_unfused_codes(m, n, dtype, residual, static):
    x, g = _rows(m, n, dtype, m * n)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    r = torch.randn(m, n, generator=g).to(dtype).to(DEVICE) if residual else None
    if m > 2:
        x[2] = 0  # a zero row: the floored scale
        if r is not None:
            r[2] = 0
    scale = torch.tensor([[0.02]], device=DEVICE) if static else None
    out = rmsnorm_fp8(x, w, 1e-5, r, static_scale=scale)
    assert len(out) == (3 if residual else 2)
    for a, b in zip(out, _unfused_triton("rmsnorm", x, scale, w, r)):
        _same(a, b)
    ref = rmsnorm_fp8_ref(x, w, 1e-5, r, static_scale=scale)
    got, want = _dequantized(*out[:2]), _dequantized(*ref[:2])
    assert ((got - want).norm() / want.norm().clamp_min(1e-30)).item() < 1e-2
    assert (out[0].view(torch.uint8) != ref[0].view(torch.uint8)).float().mean().item() < 0.02


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="the Triton e4m3 kernels run on sm89+ only")
@pytest.mark.parametrize("m,inter", [(1, 14336), (33, 14336), (4, 100), (257, 5000), (3, 20000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("static", [False, True])
def test_silu_mul_fp8_writes_the_unfused_codes(m, inter, dtype, static):
    """Rows up to SILU_ROW_MAX columns in one pass, longer ones (20000) in the two-pass loop."""
    x, _ = _rows(m, 2 * inter, dtype, m + inter)
    x = x.clamp(-60, 60)  # fp16's silu * up stays finite
    # A static scale that saturates the largest values (rows span six decades).
    scale = (silu_mul_fp8_ref(x)[1].max() * 0.5).reshape(1, 1) if static else None
    out = silu_mul_fp8(x, static_scale=scale)
    for a, b in zip(out, _unfused_triton("silu_mul", x, scale)):
        _same(a, b)
    ref = silu_mul_fp8_ref(x, static_scale=scale)
    got, want = _dequantized(*out), _dequantized(*ref)
    assert want.norm() > 0 and ((got - want).norm() / want.norm()).item() < 1e-2
