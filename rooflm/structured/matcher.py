"""Per-sequence grammar state, and the batched fill of a step's token bitmask.

Every sequence of a constrained request has its own matcher (n > 1: the n samples fork
from the prompt's matcher before any of them accepted a token). The matcher advances on
each token the output processor appends, so its state always follows the tokens the
sequence keeps: recompute preemption keeps a sequence's tokens and recomputes only
their K/V, and swapping moves only K/V, so neither touches the matcher.
"""

from __future__ import annotations

from typing import Optional

import torch


class SequenceGrammar:
    """The grammar matcher of one sequence."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.rejected = False  # a token the grammar did not allow was appended

    @classmethod
    def new(cls, compiled_grammar) -> "SequenceGrammar":
        import xgrammar as xgr
        return cls(xgr.GrammarMatcher(compiled_grammar))

    def fork(self) -> "SequenceGrammar":
        return SequenceGrammar(self.matcher.fork())

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token. False: the grammar forbids it (the mask was bypassed,
        e.g. min_tokens suppressed the only token the grammar allowed). After the grammar
        ended (its stop token was accepted; with ignore_eos generation goes on) anything goes."""
        if self.rejected:
            return False
        if self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(token_id):
            self.rejected = True
            return False
        return True

    @property
    def terminated(self) -> bool:
        return self.rejected or self.matcher.is_terminated()


_batch_matcher = None


def fill_bitmask(bitmask: torch.Tensor, rows: list[tuple[int, Optional[SequenceGrammar]]]) -> None:
    """Fill the rows of a host bitmask from their sequences' grammars, in one batched call
    (xgrammar's BatchGrammarMatcher spreads the rows over threads). A row whose grammar has
    ended keeps all-ones: its sequence finished, and the token it samples is dropped."""
    global _batch_matcher
    live = [(row, g) for row, g in rows if g is not None and not g.terminated]
    if not live:
        return
    if len(live) == 1:
        row, grammar = live[0]
        grammar.matcher.fill_next_token_bitmask(bitmask, row)
        return
    if _batch_matcher is None:
        import xgrammar as xgr
        _batch_matcher = xgr.BatchGrammarMatcher()
    _batch_matcher.batch_fill_next_token_bitmask([g.matcher for _, g in live], bitmask,
                                                 [row for row, _ in live])
