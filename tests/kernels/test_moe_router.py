"""The fused router kernel (rooflm/kernels/moe_router.py) against layers/moe.py's torch Router:
ids exactly, weights to fp32 rounding; ties lowest index first."""

import pytest
import torch

from tests.kernels.helpers import DEVICE
from rooflm.kernels.moe_router import moe_router, moe_router_ref
from rooflm.layers.moe import MoeConfig, Router


def _close(got, want):
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (256, 8), (5, 5), (3, 1)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", False), ("softmax", True), ("softmax_topk", False)])
def test_router_kernel_matches_torch_router(num_experts, top_k, scoring, renormalize):
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    hidden = 32
    cfg = MoeConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=16,
                    norm_topk_prob=renormalize, scoring=scoring, router_bias=scoring == "softmax_topk")
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
        if router.bias is not None:
            router.bias.copy_(torch.randn(num_experts, generator=gen))
    x = torch.randn(7, hidden, generator=gen)
    want_w, want_ids = router(x)
    got_w, got_ids = moe_router(router.logits(x).to(DEVICE), top_k, scoring, renormalize)
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu().long(), want_ids)
    _close(got_w, want_w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_router_reads_low_precision_logits_as_fp32(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=gen).to(dtype)
    got_w, got_ids = moe_router(logits.to(DEVICE), 8, "softmax", True)
    want_w, want_ids = moe_router_ref(logits, 8, "softmax", True)
    assert torch.equal(got_ids.cpu().long(), want_ids)
    _close(got_w, want_w)


def test_router_ties_go_lowest_index_first():
    """Equal logits: the lowest expert index first, a stable descending sort's order (torch.topk
    keeps no order among ties: the module docstring)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.5, 2.0, 2.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    stable = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :5]
    for scoring in ("softmax", "softmax_topk"):
        weights, ids = moe_router(logits.to(DEVICE), 5, scoring)
        assert ids.tolist() == stable.tolist() == [[1, 3, 4, 2, 6], [0, 1, 2, 3, 4]]
        # the same weights as torch's, whatever tied experts torch picked; with no tie cut at k,
        # the same set of experts
        _close(weights, moe_router_ref(logits, 5, scoring)[0])
        _, ids6 = moe_router(logits[:1].to(DEVICE), 6, scoring)
        assert sorted(ids6[0].tolist()) == sorted(moe_router_ref(logits[:1], 6, scoring)[1][0].tolist())


def test_router_minus_infinity_logits_are_chosen_once():
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), float("-inf")]])
    weights, ids = moe_router(logits.to(DEVICE), 3, "softmax_topk")
    assert ids.tolist() == [[1, 0, 2]]
    assert weights.tolist() == [[1.0, 0.0, 0.0]]


def test_router_rejects_bad_inputs():
    with pytest.raises(ValueError, match="top_k"):
        moe_router(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="scoring"):
        moe_router(torch.zeros(2, 4), 2, "sigmoid")
    with pytest.raises(ValueError, match="one program"):
        moe_router(torch.zeros(1, 2048), 2)
