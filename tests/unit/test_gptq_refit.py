"""GPTQ's scale refit (rooflm/quant/gptq.py refit_group_scales): same codes, lower output error."""

import pytest
import torch

from rooflm.quant.gptq import gptq_quantize, group_output_error


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_refit_lowers_the_output_error_with_the_same_codes(act_order):
    """refit keeps GPTQ's codes and zero points and only changes scales, to ones with a lower
    output error tr(dW H dW^T) (strictly lower here: GPTQ's scales are set before the
    compensation lands, so they are not the least-squares ones)."""
    g = torch.Generator().manual_seed(0)
    k, n, group = 256, 64, 64
    channel = torch.ones(k)
    channel[torch.randperm(k, generator=g)[:8]] = 10.0
    x = torch.randn(1024, k, generator=g) * channel
    w = torch.randn(n, k, generator=g) * 0.05
    h = x.T @ x
    plain = gptq_quantize(w, h, 4, group, act_order=act_order, mse=True)
    refit = gptq_quantize(w, h, 4, group, act_order=act_order, mse=True, refit=True)
    assert torch.equal(plain.codes, refit.codes) and torch.equal(plain.zeros, refit.zeros)
    before, after = group_output_error(plain, w, h), group_output_error(refit, w, h)
    assert (after <= before).all()
    assert after.sum() < 0.99 * before.sum(), (after.sum() / before.sum())
