"""kernels/gumbel_sample.py: one-pass temperature sampling (Gumbel-max) against its definition.
Small cases run under Triton's interpreter on the CPU (conftest.py), the large ones on the GPU."""

import pytest
import torch

from rooflm.kernels.gumbel_sample import gumbel_sample, gumbel_sample_ref
from tests.kernels.helpers import DEVICE

# The interpreter runs a program in ~30 ms: the statistical tests (a program per draw) are GPU-only.
GPU_ONLY = pytest.mark.gpu
DRAWS = 20000


@pytest.mark.parametrize("vocab", [7, 2048, 5000, pytest.param(128256, marks=GPU_ONLY)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_noise_is_torch_argmax(vocab, dtype):
    """Greedy rows (scale 0): the argmax, first index on ties, whatever the row count and splits."""
    torch.manual_seed(0)
    for rows in (1, 3, 300 if DEVICE == "cuda" else 12):
        logits = torch.randn(rows, vocab, device=DEVICE).to(dtype)
        logits[0, : min(vocab, 5)] = logits[0].max()  # a tie: torch takes the first
        got = gumbel_sample(logits, torch.zeros(rows, device=DEVICE))
        assert torch.equal(got, logits.float().argmax(dim=-1))


@GPU_ONLY
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("vocab", [6, 4099])
def test_draws_follow_softmax(temperature, vocab):
    """DRAWS draws of one row: the counts of its 6 likeliest tokens and of the rest against
    softmax(l / T) (chi-square, at most 6 degrees of freedom: P(> 22.5) = 0.001)."""
    torch.manual_seed(1)
    row = torch.randn(vocab, device=DEVICE) * 2
    got = gumbel_sample(row.expand(DRAWS, -1), torch.full((DRAWS,), temperature, device=DEVICE))
    probs = torch.softmax(row.double() / temperature, dim=0)
    top = probs.topk(min(6, vocab)).indices
    counts = torch.bincount(got, minlength=vocab).double()
    observed = torch.cat([counts[top], (DRAWS - counts[top].sum()).reshape(1)])
    expected = torch.cat([probs[top], (1 - probs[top].sum()).reshape(1)]) * DRAWS
    keep = expected > 0.5
    chi_square = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    assert chi_square < 22.5, (observed, expected)


def test_fresh_noise_each_call_and_torch_seed_fixes_it():
    logits = torch.zeros(24, 1000, device=DEVICE)  # uniform rows: every token equally likely
    scale = torch.ones(24, device=DEVICE)
    torch.manual_seed(2)
    a, b = gumbel_sample(logits, scale), gumbel_sample(logits, scale)
    torch.manual_seed(2)
    assert torch.equal(gumbel_sample(logits, scale), a)
    assert not torch.equal(a, b)
    assert len(set(a.tolist())) > 16  # rows draw apart, not one number for the batch


@GPU_ONLY
def test_reference_matches_in_distribution():
    """The torch reference draws from the same distribution (a coarse check on one peaked row)."""
    torch.manual_seed(3)
    row = torch.tensor([3.0, 2.0, 0.0, -1.0], device=DEVICE)
    ones = torch.ones(DRAWS, device=DEVICE)
    got = torch.bincount(gumbel_sample(row.expand(DRAWS, -1), ones), minlength=4) / DRAWS
    ref = torch.bincount(gumbel_sample_ref(row.expand(DRAWS, -1), ones), minlength=4) / DRAWS
    assert (got - ref).abs().max() < 0.02


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="noise_scale"):
        gumbel_sample(torch.zeros(3, 10, device=DEVICE), torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        gumbel_sample(torch.zeros(10, 3, device=DEVICE).t(), torch.zeros(3, device=DEVICE))
