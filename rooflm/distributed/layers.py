"""Tensor-parallel layers (Megatron-LM's split), and the builders the model calls.

- Column-parallel (fused q/k/v, fused gate/up): each rank holds a slice of the output rows of
  every fused shard; its output stays local, no communication.
- Row-parallel (o_proj, down_proj): each rank holds the matching slice of the input columns,
  computes a partial sum and one all-reduce adds them. A transformer layer has two.
- Vocab-parallel embedding: each rank holds ceil(V / N) rows; a token outside the rank's rows
  looks up zeros, and the all-reduce fills in the rank that has it.
- Vocab-parallel LM head: each rank scores its rows of the vocabulary, only for the rows that
  sample (the runner's logits indices); one all-gather assembles [rows, V].

With one rank the builders return the plain layers, so a single-device model is exactly the
model it was. Loading narrows each checkpoint tensor to the rank's part before it is read
(`checkpoint_shard`): a safetensors slice reads only those bytes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rooflm.distributed.group import SINGLE, HeadShard, TPGroup
from rooflm.layers.linear import FusedLinear, Linear


def narrow(tensor, dim: int, start: int, size: int) -> torch.Tensor:
    """tensor.narrow for tensors and for lazy checkpoint slices (model/loader.LazySlice)."""
    if size == tensor.shape[dim] and start == 0:
        return materialize(tensor)
    return tensor.narrow(dim, start, size)


def materialize(tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.load()


class ColumnParallelLinear(FusedLinear):
    """A fused linear layer holding rows [start, start + size) of each checkpoint shard."""

    def __init__(self, in_features: int, slices: dict[str, tuple[int, int]], bias: bool = False):
        super().__init__(in_features, {name: size for name, (_, size) in slices.items()}, bias=bias)
        self.slices = slices

    def load_shard(self, shard: str, param_kind: str, tensor) -> None:
        start, size = self.slices[shard]
        super().load_shard(shard, param_kind, narrow(tensor, 0, start, size))


class RowParallelLinear(Linear):
    """Input columns [start, start + in_features) of the checkpoint's weight; one all-reduce."""

    def __init__(self, in_features: int, out_features: int, start: int, tp: TPGroup, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.start = start
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora is not None:
            # This rank's columns of A give a partial delta; the all-reduce sums it with the
            # partial products (rooflm/lora/hook.py).
            y = self.lora(x, y)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias  # whole on every rank: added once, after the sum

    def forward_folded(self, x: torch.Tensor, **_) -> None:
        """Never folded: a partial sum must be all-reduced before any residual add."""
        return None

    def partial_with_residual(self, residual: torch.Tensor) -> Optional[torch.Tensor]:
        """For a kernel that fuses `x @ W^T + residual` (the decode GEMV): rank 0 adds the
        residual, the others add nothing, and the all-reduce sums them once."""
        return residual if self.tp.is_driver else None

    def checkpoint_shard(self, param_kind: str, tensor) -> torch.Tensor:
        if param_kind == "bias":
            return materialize(tensor)
        return narrow(tensor, 1, self.start, self.in_features)


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.start, self.held, rows = tp.padded_split(vocab_size)
        self.weight = torch.nn.Parameter(torch.zeros(rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.held)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def checkpoint_shard(self, param_kind: str, tensor) -> torch.Tensor:
        part = narrow(tensor, 0, self.start, self.held)
        return F.pad(part, (0, 0, 0, self.weight.shape[0] - self.held))


class ParallelLMHead(Linear):
    """The LM head's rows of the vocabulary this rank holds (its own, or the tied embedding's)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup,
                 tied: Optional[VocabParallelEmbedding] = None):
        self.vocab_size = vocab_size
        self.start, self.held, rows = tp.padded_split(vocab_size)
        super().__init__(hidden_size, rows)
        if tied is not None:
            del self.weight
            self.weight = tied.weight  # shared, not a second parameter
        self.tp = tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Gathered in the weights' dtype (the caller widens them, as one device widens its
        # logits): the same values, half the bytes on the link of an fp32 gather.
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., :self.vocab_size]

    def checkpoint_shard(self, param_kind: str, tensor) -> torch.Tensor:
        part = narrow(tensor, 0, self.start, self.held)
        return F.pad(part, (0, 0, 0, self.weight.shape[0] - self.held))


# ---- builders: what the model calls ---------------------------------------------------------

def qkv_linear(hidden_size: int, heads: HeadShard, head_dim: int, bias: bool, tp: TPGroup,
               kernel=None) -> FusedLinear:
    q = (heads.first_head * head_dim, heads.num_heads * head_dim)
    kv = (heads.first_kv_head * head_dim, heads.num_kv_heads * head_dim)
    if tp.size == 1:
        return FusedLinear(hidden_size, {"q": q[1], "k": kv[1], "v": kv[1]}, bias=bias, kernel=kernel)
    return ColumnParallelLinear(hidden_size, {"q": q, "k": kv, "v": kv}, bias=bias)


def merged_column_linear(in_features: int, shards: dict[str, int], tp: TPGroup, kernel=None) -> FusedLinear:
    if tp.size == 1:
        return FusedLinear(in_features, shards, kernel=kernel)
    return ColumnParallelLinear(in_features, {name: tp.split(size) for name, size in shards.items()})


def row_linear(in_features: int, out_features: int, tp: TPGroup, kernel=None, bias: bool = False) -> Linear:
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias, kernel=kernel)
    start, size = tp.split(in_features)
    return RowParallelLinear(size, out_features, start, tp, bias)


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TPGroup) -> torch.nn.Module:
    if tp.size == 1:
        return torch.nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(hidden_size: int, vocab_size: int, tp: TPGroup,
            tied_embedding: Optional[torch.nn.Module] = None) -> Optional[Linear]:
    """None for a tied head on one rank (the model multiplies by the embedding, as before)."""
    if tp.size == 1:
        return None if tied_embedding is not None else Linear(hidden_size, vocab_size)
    return ParallelLMHead(hidden_size, vocab_size, tp, tied_embedding)


def checkpoint_shard(module: torch.nn.Module, param_kind: str, tensor) -> torch.Tensor:
    """This rank's part of a checkpoint tensor for module's parameter (all of it if unsplit)."""
    take = getattr(module, "checkpoint_shard", None)
    return materialize(tensor) if take is None else take(param_kind, tensor)


__all__ = ["SINGLE", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "ParallelLMHead", "qkv_linear", "merged_column_linear", "row_linear", "vocab_embedding",
           "lm_head", "checkpoint_shard", "narrow", "materialize"]
