"""Rejection sampling preserves the target distribution: chi-square tests over many draws.

A tiny vocabulary (8 tokens) and fixed target rows p_0, p_1, p_2 (k = 2 drafts): for point-mass
drafts (n-gram) and for drafts drawn from a draft distribution q, the first emitted token must
follow p_0, and the second (emitted only when draft 1 was accepted) must follow p_1. The same
statistic rejects the draft distribution itself, so the test can fail.
"""

from types import SimpleNamespace

import pytest
import torch

from rooflm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from rooflm.sampling_params import SamplingParams
from rooflm.spec.decoder import SpecBatch
from rooflm.layers.rejection import verify

V = 8
K = 2
DRAWS = 20000
# Chi-square critical value for 7 degrees of freedom at p = 0.001 (a false alarm once in 1000 runs).
CHI2_CRIT_7 = 24.32


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens of nonzero probability; inf if any other appears."""
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    if counts[~keep].sum() > 0:
        return float("inf")  # a token of probability zero was emitted
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def run_verify(logits_rows: torch.Tensor, drafts: torch.Tensor, params: SamplingParams,
               q: torch.Tensor = None):
    """DRAWS independent verifying sequences, each with the same K + 1 target rows."""
    owners, rows, spec_rows = [], [], []
    request = SimpleNamespace(params=params, generator=lambda index: None)
    for s in range(DRAWS):
        sch = SimpleNamespace(request=request, seq=SimpleNamespace(seq_id=s, index=0),
                              spec_token_ids=drafts[s].tolist())
        spec_rows.append((len(rows), K))
        for _ in range(K + 1):
            rows.append(SamplingRow(params, [1], [], None))
            owners.append(sch)
    logits = logits_rows.repeat(DRAWS, 1)
    meta = SamplingMetadata.build(rows, V, "cpu")
    batch = SpecBatch(q, {s: s for s in range(DRAWS)}) if q is not None else None
    out, accepted = verify(Sampler(), logits, meta, spec_rows, owners, batch)
    emitted = out.sampled_token_ids.view(DRAWS, K + 1)
    return emitted, accepted


def target_probs(logits_rows, params):
    rows = [SamplingRow(params, [1], [], None) for _ in range(K + 1)]
    meta = SamplingMetadata.build(rows, V, "cpu")
    return Sampler.probs(logits_rows.float(), meta)


@pytest.fixture
def logits_rows():
    torch.manual_seed(0)
    return torch.randn(K + 1, V) * 1.5


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5)],
                         ids=["t1", "t0.7-topk5"])
@pytest.mark.parametrize("proposer", ["point", "draft"])
def test_emitted_tokens_follow_the_target_distribution(logits_rows, params, proposer):
    torch.manual_seed(1)
    p = target_probs(logits_rows, params)
    q = None
    if proposer == "point":
        # An n-gram proposer's fixed guess: the target's second most likely token, then token 0.
        guess = torch.tensor([int(p[0].argsort(descending=True)[1]), 0])
        drafts = guess.repeat(DRAWS, 1)
    else:
        # A draft distribution unlike the target's, with mass where the target has none.
        q_rows = torch.softmax(torch.randn(K, V), dim=-1)
        q = q_rows.repeat(DRAWS, 1, 1)
        drafts = torch.stack([torch.multinomial(q_rows[j], DRAWS, replacement=True) for j in range(K)], 1)
    emitted, accepted = run_verify(logits_rows, drafts, params, q)
    assert 0 < accepted.float().mean() < K  # both accepting and rejecting happened
    assert chi_square(emitted[:, 0], p[0]) < CHI2_CRIT_7
    second = emitted[accepted >= 1, 1]
    assert second.numel() > 2000
    assert chi_square(second, p[1]) < CHI2_CRIT_7
    # Power: the drafts' own distribution is told apart from the target's.
    if q is not None:
        assert chi_square(drafts[:, 0], p[0]) > CHI2_CRIT_7


def test_greedy_accepts_exactly_the_argmax_prefix(logits_rows):
    params = SamplingParams(temperature=0)
    best = logits_rows.argmax(dim=-1)
    drafts = torch.stack([best[:K], torch.tensor([best[0], (best[1] + 1) % V]),
                          torch.tensor([(best[0] + 1) % V, best[1]])])
    global DRAWS
    saved, DRAWS = DRAWS, 3
    try:
        emitted, accepted = run_verify(logits_rows, drafts, params)
    finally:
        DRAWS = saved
    assert accepted.tolist() == [2, 1, 0]
    assert emitted[0].tolist() == best.tolist()  # both drafts, then the bonus token
    assert emitted[1, :2].tolist() == best[:2].tolist()  # draft 1, then the correction
    assert emitted[2, 0] == best[0]
