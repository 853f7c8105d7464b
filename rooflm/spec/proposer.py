"""The proposer interface: up to k draft tokens per decoding sequence, once per step.

The engine calls propose() after scheduling, when each speculating sequence has KV slots for
its last token and num_slots drafts (a draft model writes its own K/V into the same slots of
its own pool). A proposer may return fewer drafts than slots, or none; the unused slots are
given back. A head-based proposer (EAGLE, MTP) fits the same call: it would read the target's
hidden states of the previous step, which the runner can hand it without the engine changing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rooflm.engine.request import Request, Sequence


@dataclass
class DraftRequest:
    """One sequence to draft for this step."""

    request: Request
    seq: Sequence
    start: int  # position of the sequence's last token, whose K/V the target computes this step
    num_slots: int  # drafts wanted, at most


@dataclass
class Proposal:
    drafts: list[list[int]]  # per DraftRequest, at most num_slots tokens
    # The distribution each draft was drawn from, [len(drafts), max slots, vocab] float32 on the
    # device, for the rejection sampler; None for proposers whose drafts are point masses.
    probs: Optional[torch.Tensor] = None


class Proposer:
    """Base class: a proposer without its own KV cache."""

    name = "proposer"

    def kv_bytes_per_block(self) -> int:
        """Bytes of this proposer's KV pool per block of the target's (0: it keeps none)."""
        return 0

    def allocate(self, num_blocks: int) -> None:
        """Make the KV pool, once the target's block count is known."""

    def propose(self, batch: list[DraftRequest]) -> Proposal:
        raise NotImplementedError

    def device_proposer(self) -> Optional["DeviceProposer"]:
        """The same proposer over the device loop's token histories (spec/loop.py), or None
        where it has none (then verify steps stay on the host path)."""
        return None


class DeviceProposer:
    """Drafts from token histories kept on the device: no host round trip, so the device loop
    can queue a verify step before the host has read the previous one's tokens. Point-mass
    drafts only (the loop verifies greedy sequences)."""

    def begin(self, seqs: list[tuple[Request, Sequence]], max_batch: int, device: torch.device) -> None:
        """The loop starts with these sequences in slots 0..len-1 (a proposer that keeps
        per-sequence device data builds it here)."""

    def propose(self, hist: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor,
                num_drafts: torch.Tensor, batch: int) -> None:
        """Fill drafts[:batch] [B, K] int64 and num_drafts[:batch] from hist [B, L] int32
        (lengths[b] tokens of slot b; 0: an empty slot, which gets no drafts)."""
        raise NotImplementedError
