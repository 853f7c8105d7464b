"""The default mode's linear for 2-16 rows (rooflm/kernels/small_m_linear.py) against F.linear."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DEVICE
from rooflm.kernels import small_m_linear as sml


def test_shape_choice():
    assert sml.prefers_tiles(4096, 4096) and sml.prefers_tiles(28672, 4096)  # by default every shape
    assert sml.prefers_tiles(4096, 14336, deep_only=True)       # Llama-3-8B down
    assert sml.prefers_tiles(128256, 4096, deep_only=True)      # its LM head
    assert not sml.prefers_tiles(4096, 4096, deep_only=True)    # o: cuBLAS was faster alone
    assert not sml.prefers_tiles(28672, 4096, deep_only=True)   # gate_up: cuBLAS was faster alone


def test_cpu_and_quantized_layers_take_their_own_path():
    x = torch.randn(4, 64)
    w = torch.randn(16, 64)
    b = torch.randn(16)
    torch.testing.assert_close(sml.small_m_linear(x, w, b), F.linear(x, w, b))
    calls = []

    def quant(v):
        calls.append(v.shape)
        return v[..., :16] * 2

    torch.testing.assert_close(sml.small_m_linear(x, w, b, quant), x[..., :16] * 2 + b)
    assert calls == [(4, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("n,k", [(512, 2048), (4096, 256), (384, 256)])
def test_matches_f_linear_on_gpu(rows, n, k):
    torch.manual_seed(rows)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k ** 0.5
    y = sml.small_m_linear(x, w)
    ref = F.linear(x.float(), w.float())
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
