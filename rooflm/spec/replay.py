"""Measurement only: a proposer that replays the target's own greedy continuation.

Dummy weights make real proposers useless (near-zero acceptance), so the mechanism's speed is
measured against acceptance directly: given each prompt's greedy continuation (from a plain
run), it proposes the next k tokens of it, each replaced by another token with probability
`corrupt`. Per-token acceptance is then about 1 - corrupt, and the outputs stay those of
plain greedy decoding (the verifier rejects every corrupted draft). Not for serving.
"""

from __future__ import annotations

import random

from rooflm.spec.proposer import DraftRequest, Proposal, Proposer


class ReplayProposer(Proposer):
    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt: float,
                 vocab_size: int, seed: int = 0):
        self.continuations = continuations  # prompt token ids -> greedy output token ids
        self.corrupt = corrupt
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, batch: list[DraftRequest]) -> Proposal:
        drafts = []
        for item in batch:
            prompt = tuple(item.request.prompt_token_ids)
            truth = self.continuations.get(prompt, [])
            done = item.seq.num_output_tokens
            proposal = []
            for token in truth[done:done + item.num_slots]:
                if self.rng.random() < self.corrupt:
                    token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                proposal.append(token)
            drafts.append(proposal)
        return Proposal(drafts)
