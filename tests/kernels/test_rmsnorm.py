"""RMSNorm with fused residual add (rooflm/kernels/rmsnorm.py) against HF's formula."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
from rooflm.kernels.rmsnorm import rmsnorm, rmsnorm_ref


def run_case(num_rows, hidden, dtype, with_residual, strided=False):
    x = torch.randn(num_rows, hidden * (2 if strided else 1), device=DEVICE).to(dtype)
    if strided:
        x = x[:, :hidden]  # rows with a stride larger than the hidden size
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    residual = torch.randn(num_rows, hidden, device=DEVICE).to(dtype) if with_residual else None
    x_before = x.clone()
    residual_before = residual.clone() if with_residual else None
    out = rmsnorm(x, weight, 1e-6, residual)
    ref = rmsnorm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert_close(out[0], ref[0], dtype, "normed")
        assert torch.equal(out[1], ref[1])  # x + residual rounds the same way
        assert torch.equal(residual, residual_before)
    else:
        assert_close(out, ref, dtype, "normed")
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows,hidden", [(1, 64), (7, 300), (3, 1000), (2, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(num_rows, hidden, dtype, with_residual):
    run_case(num_rows, hidden, dtype, with_residual)


def test_rmsnorm_strided_rows():
    run_case(5, 96, torch.float16, True, strided=True)


def test_rmsnorm_fp16_matches_hf_exactly():
    # Same casts as HF: the kernel's output should be bit-identical in fp16 (ties aside).
    x = torch.randn(4, 256, device=DEVICE).to(torch.float16)
    w = torch.randn(256, device=DEVICE).to(torch.float16)
    out = rmsnorm(x, w, 1e-5)
    ref = rmsnorm_ref(x, w, 1e-5)
    assert (out != ref).float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows,hidden", [(1, 4096), (4096, 4096), (333, 8192), (64, 576), (8, 16384)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_gpu_bf16(num_rows, hidden, with_residual):
    run_case(num_rows, hidden, torch.bfloat16, with_residual)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows,hidden", [(1, 64), (3, 300)])
def test_rmsnorm_post_add(num_rows, hidden, dtype):
    """A post-norm and its residual add (Gemma 2/3, OLMo 2 at one token): post_add + norm(x) with
    an fp32 (1 + w) weight, against the two torch ops; post_add untouched; not with residual."""
    x = torch.randn(num_rows, hidden, device=DEVICE).to(dtype)
    h = torch.randn(num_rows, hidden, device=DEVICE).to(dtype)
    weight = 1 + 0.1 * torch.randn(hidden, device=DEVICE)  # fp32, as OnePlusRMSNorm.fused_weight
    h_before = h.clone()
    out = rmsnorm(x, weight, 1e-6, post_add=h)
    assert out.dtype == dtype
    assert_close(out, h + rmsnorm_ref(x, weight, 1e-6).to(dtype), dtype, "post-norm + add")
    assert torch.equal(h, h_before)
    assert not torch.allclose(out.float(), rmsnorm(x, weight, 1e-6).float())  # the add happened
    with pytest.raises(ValueError, match="not both"):
        rmsnorm(x, weight, 1e-6, h, post_add=h)
