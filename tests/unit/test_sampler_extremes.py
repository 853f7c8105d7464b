"""The sampler at the extremes of every parameter SamplingParams accepts: NaN never reaches the draw.

repetition_penalty=1e-30 passed validation and made softmax NaN (a
positive seen logit / 1e-30 is +inf in float32, and inf - inf is NaN).
Validation bounds what it can (vLLM's bounds: finite, > 0), so the values left
are the ones in range that float32 cannot hold; here they go to the sampler
directly, and what reaches the draw (sample_from_probs) is checked.
"""

import itertools

import pytest
import torch

from rooflm.layers import sampler as sampler_module
from rooflm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from rooflm.sampling_params import SamplingParams

VOCAB = 64
# Seen tokens: two with positive logits, two with negative ones.
SEEN_POSITIVE = (3, 7)
SEEN_NEGATIVE = (11, 13)

REPETITION_PENALTIES = [1e-300, 1e-30, 1e-8, 1.0, 1e8, 1e30, 1e300, 1.7e308]
TEMPERATURES = [1e-30, 1e-5, 1.0, 1e30]
TOP_PS = [1e-30, 1.0]
MIN_PS = [0.0, 1.0]
OTHER = [dict(), dict(top_k=1), dict(presence_penalty=2.0, frequency_penalty=-2.0),
         dict(presence_penalty=-2.0, frequency_penalty=2.0)]


def _logits(num_rows: int) -> torch.Tensor:
    torch.manual_seed(17)
    logits = torch.randn(num_rows, VOCAB) * 3
    logits[:, list(SEEN_POSITIVE)] = torch.tensor([4.0, 5.0])
    logits[:, list(SEEN_NEGATIVE)] = torch.tensor([-4.0, -5.0])
    logits[:, VOCAB - 1] = float("-inf")  # a token the model ruled out
    return logits


def _row(params: SamplingParams) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=list(SEEN_POSITIVE + SEEN_NEGATIVE),
                       output_token_ids=[SEEN_POSITIVE[0]] * 3, generator=None)


@pytest.fixture()
def draws(monkeypatch):
    """Every probs tensor that reaches the draw, recorded."""
    seen = []
    real = sampler_module.sample_from_probs

    def recording(probs, generators):
        seen.append(probs.clone())
        return real(probs, generators)

    monkeypatch.setattr(sampler_module, "sample_from_probs", recording)
    return seen


def test_no_parameter_combination_makes_nan(draws):
    grid = list(itertools.product(REPETITION_PENALTIES, TEMPERATURES, TOP_PS, MIN_PS, OTHER))
    rows = [_row(SamplingParams(repetition_penalty=rp, temperature=t, top_p=top_p, min_p=min_p,
                                **other))
            for rp, t, top_p, min_p, other in grid]
    logits = _logits(len(rows))
    meta = SamplingMetadata.build(rows, VOCAB, "cpu")
    out = Sampler()(logits, meta)
    assert len(draws) == 1
    probs = draws[0]
    bad = ~torch.isfinite(probs).all(dim=-1)
    assert not bad.any(), [grid[i] for i in bad.nonzero().flatten().tolist()[:5]]
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(rows)), atol=1e-4)
    ids = out.sampled_token_ids
    assert ((ids >= 0) & (ids < VOCAB - 1)).all()  # never the ruled-out token


def test_a_tiny_repetition_penalty_still_means_what_it_says(draws):
    """1e-30 favours seen tokens with positive logits (divided by ~0), both of them, at random:
    the overflow is clamped, not turned into one arbitrary winner."""
    params = SamplingParams(repetition_penalty=1e-30, temperature=1.0)
    rows = [_row(params) for _ in range(400)]
    out = Sampler()(_logits(len(rows)), SamplingMetadata.build(rows, VOCAB, "cpu"))
    counts = torch.bincount(out.sampled_token_ids, minlength=VOCAB)
    assert counts[list(SEEN_POSITIVE)].sum() == len(rows)
    assert counts[SEEN_POSITIVE[0]] > 100 and counts[SEEN_POSITIVE[1]] > 100
    assert torch.isfinite(draws[0]).all()


@pytest.mark.parametrize("penalty", [1e30, 1e300, 1.7e308])
def test_a_huge_repetition_penalty_rules_out_seen_negative_tokens(penalty, draws):
    params = SamplingParams(repetition_penalty=penalty, temperature=1.0)
    rows = [_row(params) for _ in range(200)]
    out = Sampler()(_logits(len(rows)), SamplingMetadata.build(rows, VOCAB, "cpu"))
    picked = set(out.sampled_token_ids.tolist())
    assert not picked & set(SEEN_NEGATIVE)
    assert torch.isfinite(draws[0]).all()


def test_greedy_rows_with_extreme_penalties_take_a_seen_positive_token():
    rows = [_row(SamplingParams(repetition_penalty=rp, temperature=0.0))
            for rp in (1e-300, 1e-30)]
    out = Sampler()(_logits(len(rows)), SamplingMetadata.build(rows, VOCAB, "cpu"))
    assert set(out.sampled_token_ids.tolist()) <= set(SEEN_POSITIVE)
