"""Verification of drafted tokens: which drafts the target model accepts, and the token after.

A verifying sequence with drafts d_1..d_k has k + 1 sampling rows: row j holds the target's
logits after d_j (row 0: after the sequence's last token), so row j - 1 scores d_j and row k
gives a bonus token when every draft is accepted.

Greedy rows accept d_j while it is the argmax of row j - 1, then emit the argmax of the first
row that disagrees (or of row k): exactly the tokens plain greedy decoding gives.

Random rows use speculative sampling (Leviathan et al. 2023; Chen et al. 2023): d_j, drawn from
the proposer's distribution q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j)),
where p_j is the distribution the sampler would draw from (penalties, temperature, top-k,
top-p, min-p: Sampler.probs). At the first rejection the token is drawn from
max(0, p_j - q_j), renormalised; if all k are accepted, from p_{k+1}. Each emitted token is
then distributed exactly as p: the method is lossless. An n-gram proposer's q is a point mass
on its draft, so the acceptance test is u < p_j(d_j) and the residual is p_j without d_j.

Seeded rows draw their uniforms and the residual's noise from the request's own generator
(a seeded run is reproducible); no device-host sync happens here.

The acceptance test (accept_drafts) and a point-mass proposer's residual (point_mass_residual_)
are shared with speculative decoding's device loop (rooflm/spec/loop.py), which applies them to
every row inside a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from rooflm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, to_device, sample_from_probs


def verify(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata,
           spec_rows: list[tuple[int, int]], row_owner: list, spec_batch=None
           ) -> tuple[SamplerOutput, torch.Tensor]:
    """Sample a step whose batch holds verifying sequences.

    spec_rows: (first row, number of drafts) per verifying sequence; row_owner: the
    ScheduledSeq of each row (its spec_token_ids are the drafts). spec_batch: the proposer's
    draft distributions (spec.decoder.SpecBatch), None for point-mass proposers.
    Returns the SamplerOutput over all rows (a verifying sequence's rows hold its accepted
    drafts, then the emitted token, then repeats of it) and the accepted count per sequence.
    """
    raw = logits.float()
    processed = sampler.process_logits(raw, meta)
    sampled = sampler.choose(processed, meta).clone()  # plain rows; verifying rows are overwritten
    dev = logits.device
    owners = [row_owner[first] for first, _ in spec_rows]
    num_seqs = len(spec_rows)
    max_k = max(k for _, k in spec_rows)
    # Host lists go up through pinned memory without blocking: torch.tensor(list, device=cuda)
    # copies from pageable memory, which waits for the queued forward (the H100 profile of
    # 2026-11-25: 6.7 ms a step at batch 16, the sampling launches serialised behind it).
    index = to_device(torch.tensor([[first + min(j, k) for j in range(max_k + 1)] for first, k in spec_rows]),
                       dev)
    drafts = to_device(torch.tensor([sch.spec_token_ids + [0] * (max_k - len(sch.spec_token_ids))
                                      for sch in owners], dtype=torch.int64), dev)
    num_drafts = to_device(torch.tensor([k for _, k in spec_rows]), dev)
    valid = torch.arange(max_k, device=dev)[None, :] < num_drafts[:, None]
    greedy = [sch.request.params.greedy for sch in owners]

    target = processed[index].argmax(dim=-1)  # [S, K + 1]
    accept = drafts == target[:, :max_k]
    seqs = torch.arange(num_seqs, device=dev)
    final = None
    if not all(greedy):
        probs = sampler.probs(processed, meta)[index]  # [S, K + 1, V]
        q = spec_batch.draft_probs_for([sch.seq.seq_id for sch in owners], max_k) if spec_batch else None
        accept_random = _accept_random(probs, q, drafts, owners, max_k)
        greedy_t = to_device(torch.tensor(greedy), dev)
        accept = torch.where(greedy_t[:, None], accept, accept_random)
    accept &= valid
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # [S]
    final = target[seqs, num_accepted]
    if not all(greedy):
        residual = _residual(probs, q, drafts, num_accepted, num_drafts, max_k)
        generators = [(s, sch.request.generator(sch.seq.index)) for s, sch in enumerate(owners)
                      if sch.request.generator(sch.seq.index) is not None and not sch.request.params.greedy]
        drawn = sample_from_probs(residual, generators)
        final = torch.where(greedy_t, final, drawn)
    columns = torch.arange(max_k + 1, device=dev)[None, :]
    padded = torch.cat([drafts, drafts.new_zeros(num_seqs, 1)], dim=1)
    emitted = torch.where(columns < num_accepted[:, None], padded, final[:, None])
    # Padding columns repeat a sequence's last row, whose value is `final` too: the duplicate
    # indices write equal values.
    sampled[index.flatten()] = emitted.flatten()
    return sampler.with_logprobs(raw, sampled, meta), num_accepted


def accept_drafts(u: torch.Tensor, p_draft: torch.Tensor, q_draft: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Speculative sampling's test of each draft d, from a uniform u: accepted where
    u < p(d) / q(d), written u * q(d) < p(d) so that q(d) = 0 never divides. A point-mass
    proposer (q_draft None) has q(d) = 1: u < p(d)."""
    if q_draft is None:
        return u < p_draft
    return u * q_draft < p_draft


def point_mass_residual_(probs: torch.Tensor, drafts: torch.Tensor, p_draft: torch.Tensor,
                         rejected: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) for a point-mass q on each draft, in place over probs [..., V]: the
    draft's probability becomes 0 where `rejected`, and p stays itself elsewhere (p_draft:
    probs at the drafts [...], as the acceptance test read them). Unnormalised, as
    sample_from_probs takes it."""
    return probs.scatter_(-1, drafts[..., None], torch.where(rejected, 0.0, p_draft)[..., None])


def _accept_random(probs: torch.Tensor, q: Optional[torch.Tensor], drafts: torch.Tensor,
                   owners: list, max_k: int) -> torch.Tensor:
    p_draft = probs[:, :max_k].gather(-1, drafts[..., None]).squeeze(-1)  # [S, K]
    q_draft = None if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(p_draft.shape, device=p_draft.device)
    for s, sch in enumerate(owners):
        generator = sch.request.generator(sch.seq.index)
        if generator is not None and not sch.request.params.greedy:
            k = len(sch.spec_token_ids)
            u[s, :k] = torch.rand(k, generator=generator, device=u.device)
    return accept_drafts(u, p_draft, q_draft)


def _residual(probs: torch.Tensor, q: Optional[torch.Tensor], drafts: torch.Tensor,
              num_accepted: torch.Tensor, num_drafts: torch.Tensor, max_k: int) -> torch.Tensor:
    """Unnormalised weights of the emitted token: max(0, p - q) at the first rejection, p of
    the bonus row when every draft was accepted (sample_from_probs needs no normalisation)."""
    seqs = torch.arange(probs.shape[0], device=probs.device)
    p = probs[seqs, num_accepted]  # [S, V]
    at = num_accepted.clamp(max=max_k - 1)
    rejected = num_accepted < num_drafts
    if q is None:
        draft = drafts[seqs, at]
        residual = point_mass_residual_(p.clone(), draft, p.gather(1, draft[:, None]).squeeze(1), rejected)
    else:
        residual = (p - q[seqs, at]).clamp_min(0.0)
        residual = torch.where(rejected[:, None], residual, p)
    # p == q on every token leaves no residual mass; a rejection then cannot happen except by
    # rounding, and p is the right answer.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)
