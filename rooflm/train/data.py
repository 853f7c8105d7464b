"""Training data: one long stream of token ids, cut into windows of seq_len + 1 tokens.

Where the stream comes from:
  *.npy             a 1-D array of token ids
  *.ids             whitespace-separated integer token ids (a text file)
  any other file    text, tokenized with the model's tokenizer
  no file           synthetic: uniform random ids over the vocabulary (benchmarks of dummy shapes)

Which windows a step reads is a pure function of (seed, step, micro-step, rank): the
window of global sample k starts at a position drawn from a generator seeded with k.
A resumed run therefore reads exactly what the uninterrupted run would have read, and
a run over N ranks with micro-batch b reads the same samples as one rank with N x b.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

SYNTHETIC = "synthetic"


def read_token_ids(path: str, vocab_size: int, tokenizer=None) -> torch.Tensor:
    """The token stream of a data file as int64, every id checked against the vocabulary."""
    if not os.path.isfile(path):
        raise ValueError(f"training data file not found: {path}")
    if path.endswith(".npy"):
        import numpy as np

        ids = torch.from_numpy(np.load(path).astype("int64").reshape(-1))
    elif path.endswith(".ids"):
        with open(path, encoding="utf-8") as f:
            try:
                ids = torch.tensor([int(t) for t in f.read().split()], dtype=torch.int64)
            except ValueError as exc:
                raise ValueError(f"{path}: a .ids file holds whitespace-separated integers: {exc}")
    else:
        if tokenizer is None:
            raise ValueError(
                f"{path} is text, and this model has no tokenizer (a dummy preset?): pass token "
                f"ids (.npy or .ids), a model with a tokenizer, or no --data for synthetic tokens")
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)
    if ids.numel() == 0:
        raise ValueError(f"{path} holds no tokens")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        first = int(ids[bad][0])
        raise ValueError(f"{path}: token id {first} is outside the model's vocabulary "
                         f"(0..{vocab_size - 1})")
    return ids


class TokenWindows:
    """Fixed-length (input, target) windows of a token stream; see the module doc."""

    def __init__(self, tokens: Optional[torch.Tensor], seq_len: int, vocab_size: int, seed: int = 0,
                 source: str = SYNTHETIC):
        if tokens is not None and tokens.numel() < seq_len + 2:
            raise ValueError(f"{source} has {tokens.numel()} tokens; a window of seq-len {seq_len} "
                             f"needs at least {seq_len + 2}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.source = source

    def _window(self, sample: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sample)
        if self.tokens is None:
            return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)
        start = int(torch.randint(0, self.tokens.numel() - self.seq_len - 1, (1,), generator=gen))
        return self.tokens[start:start + self.seq_len + 1]

    def batch(self, step: int, micro_step: int, grad_accum: int, rank: int, world_size: int,
              micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [micro_batch, seq_len], for one micro-step of one rank."""
        first = ((step * grad_accum + micro_step) * world_size + rank) * micro_batch
        windows = torch.stack([self._window(first + j) for j in range(micro_batch)])
        return windows[:, :-1], windows[:, 1:]
