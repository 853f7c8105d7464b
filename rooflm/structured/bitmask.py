"""The token bitmask: which tokens a grammar allows next, one bit per token, and its application.

Layout (xgrammar's, which vLLM and SGLang share): int32 words, [num_rows, ceil(V / 32)];
token t of a row is allowed when bit (t % 32) of word (t // 32) is set. A row of all ones
(-1) allows everything: the rows of unconstrained sequences in a mixed batch.

The mask is filled on the host (the grammar matchers live there), copied to the device
with the step's other sampling tensors, and applied to the logits on the device: a
[N, V / 32] int32 copy instead of a [N, V] one, 4 KB per row at Llama 3's 128k vocabulary.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 32


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask that allows every token in every row."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 words -> [N, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit reads as 1 too
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token the bitmask forbids set to -inf. Out of place; one batched
    pass over [N, V] on the logits' device, no host sync.

    A model's logits can be wider than the tokenizer's vocabulary (padded embedding
    rows): columns past the bitmask's width are forbidden, as no grammar can emit them.
    """
    num_rows, vocab = logits.shape
    width = bitmask.shape[1] * BITS_PER_WORD
    allowed = unpack_bitmask(bitmask, min(vocab, width))
    if vocab > width:
        allowed = torch.cat([allowed, allowed.new_zeros(num_rows, vocab - width)], dim=1)
    return logits.masked_fill(~allowed, float("-inf"))
