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

from rooflm.spec.proposer import DraftRequest, Proposal, Proposer


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

    def propose(self, batch: list[DraftRequest]) -> Proposal:
        drafts = []
        for item in batch:
            prompt = tuple(item.request.prompt_token_ids)
            truth = self.continuations.get(prompt, [])
            key = hash(prompt) ^ self.seed  # ints hash the same in every process
            done = item.seq.num_output_tokens
            proposal = []
            for position in range(done, min(done + item.num_slots, len(truth))):
                token = truth[position]
                if _unit(key, position) < self.corrupt:
                    shift = 1 + int(_unit(key + 1, position) * (self.vocab_size - 1))
                    token = (token + shift) % self.vocab_size
                proposal.append(token)
            drafts.append(proposal)
        return Proposal(drafts)
