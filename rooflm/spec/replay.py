"""Measurement only: a proposer that replays the target's own greedy continuation.

Dummy weights make real proposers useless (near-zero acceptance), so the mechanism's speed is
measured against acceptance directly: given each prompt's greedy continuation (from an earlier
run), it proposes the next k tokens of it, each output position corrupted (replaced by another
token) with probability `corrupt`. Which positions are corrupted is a fixed function of the
prompt and the position, not of the order of proposals, so reruns see the same pattern. A
draft matches the target's choice with probability about 1 - corrupt, and outputs stay those
of greedy decoding (the verifier rejects every wrong draft). Not for serving.
"""

from __future__ import annotations

import torch

from rooflm.spec.proposer import DeviceProposer, DraftRequest, Proposal, Proposer


def _unit(key: int, position: int) -> float:
    """A fixed pseudo-random number in [0, 1) per (key, position) (splitmix64's mixer)."""
    x = (key * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


class ReplayProposer(Proposer):
    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt: float,
                 vocab_size: int, seed: int = 0):
        self.continuations = continuations  # prompt token ids -> greedy output token ids
        self.corrupt = corrupt
        self.vocab_size = vocab_size
        self.seed = seed

    def draft_at(self, prompt: tuple[int, ...], truth: list[int], position: int) -> int:
        """The draft for output position `position`: the truth, or (corrupted) another token."""
        key = hash(prompt) ^ self.seed  # ints hash the same in every process
        token = truth[position]
        if _unit(key, position) < self.corrupt:
            shift = 1 + int(_unit(key + 1, position) * (self.vocab_size - 1))
            token = (token + shift) % self.vocab_size
        return token

    def propose(self, batch: list[DraftRequest]) -> Proposal:
        drafts = []
        for item in batch:
            prompt = tuple(item.request.prompt_token_ids)
            truth = self.continuations.get(prompt, [])
            done = item.seq.num_output_tokens
            drafts.append([self.draft_at(prompt, truth, p)
                           for p in range(done, min(done + item.num_slots, len(truth)))])
        return Proposal(drafts)

    def device_proposer(self) -> "ReplayDeviceProposer":
        return ReplayDeviceProposer(self)


class ReplayDeviceProposer(DeviceProposer):
    """The replay's drafts for the device loop: at begin(), each slot's drafts by output
    position go into a device table; a step gathers the K after the slot's output so far."""

    def __init__(self, replay: ReplayProposer):
        self.replay = replay
        self.table = self.prompt_lens = self.truth_lens = None

    def begin(self, seqs, max_batch: int, device) -> None:
        rows = []
        for req, _ in seqs:
            prompt = tuple(req.prompt_token_ids)
            truth = self.replay.continuations.get(prompt, [])
            rows.append([self.replay.draft_at(prompt, truth, p) for p in range(len(truth))])
        width = max([len(r) for r in rows] + [1])
        table = torch.zeros(max_batch, width, dtype=torch.int64)
        for b, r in enumerate(rows):
            table[b, :len(r)] = torch.tensor(r, dtype=torch.int64)
        lens = torch.zeros(max_batch, dtype=torch.int64)
        lens[:len(rows)] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        prompts = torch.zeros(max_batch, dtype=torch.int64)
        prompts[:len(seqs)] = torch.tensor([len(req.prompt_token_ids) for req, _ in seqs], dtype=torch.int64)
        self.table, self.truth_lens, self.prompt_lens = table.to(device), lens.to(device), prompts.to(device)

    def propose(self, hist, lengths, drafts, num_drafts, batch: int) -> None:
        k = drafts.shape[1]
        done = (lengths[:batch] - self.prompt_lens[:batch]).clamp_min(0)  # output tokens so far
        count = (self.truth_lens[:batch] - done).clamp(0, k)
        count = torch.where(lengths[:batch] > 0, count, 0)
        cols = torch.arange(k, device=hist.device)
        index = (done[:, None] + cols[None, :]).clamp_max(self.table.shape[1] - 1)
        drafts[:batch] = torch.where(cols[None, :] < count[:, None], self.table[:batch].gather(1, index), 0)
        num_drafts[:batch] = count
