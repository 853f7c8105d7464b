"""SiLU-and-mul (rooflm/kernels/silu_mul.py) against torch's silu(gate) * up."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
from rooflm.kernels.silu_mul import silu_mul, silu_mul_ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows,inter", [(1, 64), (5, 1500), (3, 2048), (2, 17)])
def test_silu_mul_matches_reference(num_rows, inter, dtype):
    x = 3 * torch.randn(num_rows, 2 * inter, device=DEVICE).to(dtype)
    assert_close(silu_mul(x), silu_mul_ref(x), dtype)


def test_silu_mul_strided_rows():
    x = torch.randn(4, 3 * 128, device=DEVICE).to(torch.float16)[:, :256]
    assert_close(silu_mul(x), silu_mul_ref(x), torch.float16)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy exp in the interpreter
def test_silu_mul_extreme_gates():
    x = torch.tensor([[-100.0, 0.0, 100.0, 2.0, 3.0, -1.0]], device=DEVICE)
    out = silu_mul(x)
    assert torch.isfinite(out).all()
    assert_close(out, silu_mul_ref(x), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows,inter", [(1, 14336), (4096, 14336), (77, 1536), (2048, 8192)])
def test_silu_mul_gpu_bf16(num_rows, inter):
    x = 3 * torch.randn(num_rows, 2 * inter, device=DEVICE).to(torch.bfloat16)
    assert_close(silu_mul(x), silu_mul_ref(x), torch.bfloat16)
