"""Turns one step's logits into the next token of each sequence.

Per step: logprobs of the raw distribution -> repetition / frequency /
presence penalties -> logit_bias -> suppressed tokens -> the grammar's token
bitmask (structured outputs) -> greedy rows take the argmax; the
other rows go through temperature -> top-k -> top-p -> min-p and are sampled
with the exponential race (gpt-fast): argmax(probs / q), q ~ Exponential(1),
which draws from `probs` without a device-host sync (no multinomial). On CUDA,
a batch whose rows ask for nothing but a temperature (temperature_only) takes
one kernel instead, the same race as a Gumbel-max over the logits
(kernels/gumbel_sample.py).

Logprobs are of the model's own distribution, log_softmax of the logits
before penalties and temperature (vLLM's default "raw_logprobs"): they say how
likely the model found a token, independent of how the request chose to
sample, and they are the numbers to compare against HF transformers.

Batch independence: every operation is row-wise, so a row's token does not
depend on its neighbours. A seeded row draws its noise from its own
torch.Generator, so a seeded request is reproducible whatever else is in the
batch. Rows without a generator share one batched draw from the global RNG.

Device-host syncs: none in Sampler.forward. SamplingMetadata.build runs on
the host and copies its tensors to the device (pinned + non_blocking on
CUDA). The engine syncs when it reads the sampled ids back (.tolist()).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

import rooflm.envs as envs
from rooflm.sampling_params import SamplingParams
from rooflm.structured.bitmask import apply_token_bitmask


@dataclass
class SamplingRow:
    """What the engine knows of one sequence to sample this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, for penalties
    generator: Optional[torch.Generator]  # on the logits' device; None: global RNG
    # Ids to forbid this step: EOS and stop_token_ids while
    # len(output_token_ids) < min_tokens. The engine fills it.
    suppress_token_ids: tuple[int, ...] = ()


# The largest logit a penalty may produce. Finite after division by the
# smallest temperature the sampler divides by (GREEDY_TEMPERATURE_EPS: smaller
# ones are greedy; 1e30 / 1e-5 = 1e35 < float32's 3.4e38), so softmax never sees inf.
LOGIT_LIMIT = 1e30

# The repetition penalty as the sampler applies it: float32 holds neither
# 1e-300 (it rounds to 0, and x / 0 is inf, 0 * inf NaN) nor 1e300 (inf). Past
# these bounds the clamped logits are the same whatever the penalty.
REPETITION_PENALTY_RANGE = (1e-30, 1e30)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, without a device-host sync (the sampler's and spec's inputs)."""
    if device.type == "cuda":
        # Pinned memory makes the copy truly asynchronous.
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[N, V] float32 count of each token id in each row's list."""
    num_rows = len(token_lists)
    max_len = max((len(ids) for ids in token_lists), default=0)
    # Pad with an extra column (vocab_size) that is dropped after counting.
    padded = torch.full((num_rows, max(max_len, 1)), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(token_lists):
        if ids:
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    padded = to_device(padded, device)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass
class SamplingMetadata:
    """The per-row parameters of one step, as tensors on the logits' device.

    Optional tensors are None when no row of the batch uses the feature, so a
    plain batch pays for nothing it does not use.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_mask: Optional[torch.Tensor]  # [N] bool, None when all rows agree
    temperature: Optional[torch.Tensor]  # [N, 1] float32; 1.0 on greedy rows
    top_k: Optional[torch.Tensor]  # [N, 1] int64; vocab_size where disabled
    top_p: Optional[torch.Tensor]  # [N, 1] float32; 1.0 where disabled
    min_p: Optional[torch.Tensor]  # [N, 1] float32; 0.0 where disabled
    repetition_penalty: Optional[torch.Tensor]  # [N, 1] float32
    seen_mask: Optional[torch.Tensor]  # [N, V] bool: in the prompt or the output
    frequency_penalty: Optional[torch.Tensor]  # [N, 1] float32
    presence_penalty: Optional[torch.Tensor]  # [N, 1] float32
    output_counts: Optional[torch.Tensor]  # [N, V] float32
    suppress_rows: Optional[torch.Tensor]  # [S] int64 row index of each suppressed id
    suppress_ids: Optional[torch.Tensor]  # [S] int64 token id
    generators: list[tuple[int, torch.Generator]]  # (row, generator) of seeded random rows
    max_num_logprobs: Optional[int]  # None: no row asked for logprobs
    # logit_bias of every row, flattened: one sparse add for the batch, no per-row loop.
    bias_rows: Optional[torch.Tensor] = None  # [B] int64 row index
    bias_ids: Optional[torch.Tensor] = None  # [B] int64 token id
    bias_values: Optional[torch.Tensor] = None  # [B] float32
    # Structured outputs: [N, ceil(V / 32)] int32 on the device, all ones on unconstrained
    # rows; set by the runner once the grammar matchers have filled it.
    token_bitmask: Optional[torch.Tensor] = None

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> "SamplingMetadata":
        device = torch.device(device)
        params = [row.params for row in rows]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def column(values, dtype) -> torch.Tensor:
            # numpy builds the host array from a list 3x faster than torch.tensor does.
            array = np.array(values, dtype=np.float32 if dtype == torch.float32 else np.int64)
            return to_device(torch.from_numpy(array).unsqueeze(1), device)

        greedy_mask = None
        if not all_greedy and not all_random:
            greedy_mask = to_device(torch.tensor(greedy, dtype=torch.bool), device)

        temperature = top_k = top_p = min_p = None
        generators: list[tuple[int, torch.Generator]] = []
        if not all_greedy:
            # One comprehension per column rather than a loop of appends: built every step for
            # every row (hundreds at a large batch). Greedy rows take the argmax; neutral values
            # keep the batched math of the random path well defined for them. Temperatures too
            # small to divide by are greedy (SamplingParams.greedy), so the rest divide safely.
            temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
            top_ks = [vocab_size if g or p.top_k <= 0 else p.top_k for p, g in zip(params, greedy)]
            top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
            min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
            generators = [(i, row.generator) for i, (row, g) in enumerate(zip(rows, greedy))
                          if not g and row.generator is not None]
            temperature = column(temperatures, torch.float32)
            if any(k < vocab_size for k in top_ks):
                top_k = column(top_ks, torch.int64)
            if any(value < 1.0 for value in top_ps):
                top_p = column(top_ps, torch.float32)
            if any(value > 0.0 for value in min_ps):
                min_p = column(min_ps, torch.float32)

        # Penalties: token lists are only counted for the rows that use them;
        # the other rows keep zero counts and neutral penalty values.
        repetition_penalty = seen_mask = None
        if any(p.repetition_penalty != 1.0 for p in params):
            low, high = REPETITION_PENALTY_RANGE
            penalties = [min(max(p.repetition_penalty, low), high) for p in params]
            repetition_penalty = column(penalties, torch.float32)
            seen_lists = []
            for row in rows:
                if row.params.repetition_penalty != 1.0:
                    seen_lists.append(row.prompt_token_ids + row.output_token_ids)
                else:
                    seen_lists.append([])
            seen_mask = _token_counts(seen_lists, vocab_size, device) > 0

        frequency_penalty = presence_penalty = output_counts = None
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency_penalty = column([p.frequency_penalty for p in params], torch.float32)
            presence_penalty = column([p.presence_penalty for p in params], torch.float32)
            output_lists = []
            for row in rows:
                if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0:
                    output_lists.append(row.output_token_ids)
                else:
                    output_lists.append([])
            output_counts = _token_counts(output_lists, vocab_size, device)

        suppress_rows = suppress_ids = None
        row_indices, token_ids = [], []
        for i, row in enumerate(rows):
            for token_id in row.suppress_token_ids:
                # An id outside the vocabulary can never be sampled anyway.
                if 0 <= token_id < vocab_size:
                    row_indices.append(i)
                    token_ids.append(token_id)
        if token_ids:
            suppress_rows = to_device(torch.tensor(row_indices, dtype=torch.int64), device)
            suppress_ids = to_device(torch.tensor(token_ids, dtype=torch.int64), device)

        bias_rows = bias_ids = bias_values = None
        if any(p.logit_bias for p in params):
            row_indices, token_ids, values = [], [], []
            for i, p in enumerate(params):
                for token_id, value in (p.logit_bias or {}).items():
                    if 0 <= token_id < vocab_size:  # the engine refuses others at admission
                        row_indices.append(i)
                        token_ids.append(token_id)
                        values.append(value)
            bias_rows = to_device(torch.tensor(row_indices, dtype=torch.int64), device)
            bias_ids = to_device(torch.tensor(token_ids, dtype=torch.int64), device)
            bias_values = to_device(torch.tensor(values, dtype=torch.float32), device)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(requested) if requested else None

        return cls(
            num_rows=len(rows),
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seen_mask=seen_mask,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            output_counts=output_counts,
            suppress_rows=suppress_rows,
            suppress_ids=suppress_ids,
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            bias_rows=bias_rows,
            bias_ids=bias_ids,
            bias_values=bias_values,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64, on the logits' device
    # Sampled token first, then the top max_num_logprobs ids by logprob; a row
    # that asked for k alternatives reads the first 1 + k columns.
    logprob_token_ids: Optional[torch.Tensor]  # [N, 1 + max_num_logprobs] int64
    logprobs: Optional[torch.Tensor]  # [N, 1 + max_num_logprobs] float32
    ranks: Optional[torch.Tensor]  # [N] int64 rank of the sampled token, 1 = argmax


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob and rank of token_ids[i] under logits[i], plus the top num_top.

    Serves both the sampled tokens and prompt logprobs (logits of position i,
    token_ids = the prompt token at i + 1). Returns ids [N, 1 + num_top]
    int64, logprobs [N, 1 + num_top] float32 (the given token first, then the
    alternatives in descending order) and ranks [N] int64 (1 = most likely;
    tied tokens share the better rank).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    if num_top > 0:
        top_logprobs, top_ids = torch.topk(logprobs, num_top, dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        values = torch.cat([token_logprobs, top_logprobs], dim=1)
    else:
        ids = token_ids
        values = token_logprobs
    return ids, values, ranks


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.repetition_penalty is not None:
        # HF/CTRL semantics: push seen tokens towards zero probability whatever
        # the logit's sign, so divide positive logits and multiply negative ones.
        penalty = meta.repetition_penalty
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        # Any penalty far from 1 overflows here (a logit of 5 / 1e-30 is +inf in
        # float32), and two +inf logits make softmax NaN. Clamping keeps the
        # penalty's meaning (seen tokens pushed to the extreme) with finite values;
        # -inf (a token already ruled out) passes unchanged.
        penalised = penalised.clamp(min=-LOGIT_LIMIT, max=LOGIT_LIMIT)
        penalised = torch.where(torch.isneginf(logits), logits, penalised)
        logits = torch.where(meta.seen_mask, penalised, logits)
    if meta.output_counts is not None:
        # OpenAI semantics, output tokens only: frequency scales with the
        # count, presence is a flat charge for having appeared at all.
        counts = meta.output_counts
        logits = logits - meta.frequency_penalty * counts
        logits = logits - meta.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Mask to -inf what top-k then top-p exclude; one sort serves both."""
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    positions = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    if top_k is not None:
        sorted_logits = sorted_logits.masked_fill(positions >= top_k, float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Mass strictly before each token: the most likely token always
        # survives, and a token is dropped once the ones above it reach top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # top_p == 1 rows are skipped outright: cumsum rounding could otherwise
        # push the mass before a tail token a hair over 1.0.
        drop = (mass_before > top_p) & (top_p < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample_from_probs(
    probs: torch.Tensor, generators: list[tuple[int, torch.Generator]]
) -> torch.Tensor:
    """argmax(probs / q), q ~ Exponential(1): an exact draw from probs.

    Token i wins when q_i / p_i is the smallest; q_i / p_i ~ Exponential(p_i),
    and the minimum of independent exponentials is i with probability p_i.
    """
    q = torch.empty_like(probs).exponential_()
    for row, generator in generators:
        q[row].exponential_(generator=generator)
    # A zero draw would make 0 / 0 = NaN on a masked token, and argmax picks NaN.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return torch.argmax(probs / q, dim=-1)


def temperature_only(meta: SamplingMetadata) -> bool:
    """Whether every row is greedy or plain temperature sampling from the global RNG: no
    penalty, bias, suppressed id, grammar mask, top-k/p, min-p or per-request generator."""
    return (not meta.all_greedy and meta.top_k is None and meta.top_p is None and meta.min_p is None
            and meta.repetition_penalty is None and meta.frequency_penalty is None and meta.suppress_rows is None
            and meta.bias_rows is None and meta.token_bitmask is None and not meta.generators)


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # ROOFLM_FUSED_SAMPLING=0: temperature-only batches on CUDA take the torch path too (the A/B switch).
        if envs.cached.ROOFLM_FUSED_SAMPLING and logits.is_cuda and temperature_only(meta):
            # One pass over the logits (kernels/gumbel_sample.py): the same distribution.
            from rooflm.kernels.gumbel_sample import gumbel_sample
            scale = meta.temperature[:, 0]
            if meta.greedy_mask is not None:
                scale = scale.masked_fill(meta.greedy_mask, 0.0)
            sampled = gumbel_sample(logits, scale)
            return self.with_logprobs(logits.float() if meta.max_num_logprobs is not None else logits, sampled, meta)
        logits = logits.float()
        raw_logits = logits
        logits = self.process_logits(logits, meta)
        sampled = self.choose(logits, meta)
        return self.with_logprobs(raw_logits, sampled, meta)

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Penalties, logit_bias, suppressed tokens and the grammar's mask, before temperature."""
        logits = apply_penalties(logits, meta)
        if meta.bias_rows is not None:
            logits = logits.index_put((meta.bias_rows, meta.bias_ids), meta.bias_values,
                                      accumulate=True)
        if meta.suppress_rows is not None:
            # new_full fills on the device; a Python-built tensor would be a copy.
            minus_inf = logits.new_full((), float("-inf"))
            logits = logits.index_put((meta.suppress_rows, meta.suppress_ids), minus_inf)
        if meta.token_bitmask is not None:
            # Last, so no bias or penalty can bring back a token the grammar forbids.
            logits = apply_token_bitmask(logits, meta.token_bitmask)
        return logits

    def choose(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Each row's token from its processed logits: the argmax or a draw."""
        if meta.all_greedy:
            sampled = torch.argmax(logits, dim=-1)
        else:
            random_sampled = self._sample_random(logits, meta)
            if meta.all_random:
                sampled = random_sampled
            else:
                greedy_sampled = torch.argmax(logits, dim=-1)
                sampled = torch.where(meta.greedy_mask, greedy_sampled, random_sampled)
        return sampled

    @staticmethod
    def with_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor,
                      meta: SamplingMetadata) -> SamplerOutput:
        logprob_token_ids = logprobs = ranks = None
        if meta.max_num_logprobs is not None:
            logprob_token_ids, logprobs, ranks = compute_logprobs(
                raw_logits, sampled, meta.max_num_logprobs
            )
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=logprob_token_ids,
            logprobs=logprobs,
            ranks=ranks,
        )

    @classmethod
    def _sample_random(cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return sample_from_probs(cls.probs(logits, meta), meta.generators)

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from: temperature, top-k, top-p, min-p, softmax
        (speculative decoding's rejection sampler preserves exactly this one)."""
        logits = logits / meta.temperature
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        return torch.softmax(logits, dim=-1)
