"""The per-linear LoRA hook and its installation on a decoder's targeted linears.

Beside a linear (fused or not) the hook holds every slot's A and B, views into the model's one
slot pool [slots, elements] (a slot is one row, so an adapter's host image goes in with one copy):
    lora_a [slots, shards x R, in]   shard i's A in rows [i R, i R + r) (zero-padded to R)
    lora_b [slots, out, R]           shard i's B in its output rows, the adapter's scaling folded in
and adds, for each token t under slot s = slot(t):
    y[t, shard i] += (x_t @ A_s,i^T) @ B_s,i^T
The shrink reads x once for all shards of a fused linear (q, k, v or gate, up). On CUDA the two
halves are the Triton SGMV kernels (rooflm/kernels/lora_shrink.py, lora_expand.py); on the
CPU the torch path below, a loop over the step's slots, is the reference.

A hook exists only with --enable-lora; without it Linear.forward pays one attribute test.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from rooflm.layers.linear import FusedLinear, Linear
from rooflm.lora.mapping import LoRAMapping

logger = logging.getLogger(__name__)


class LoRALinearHook:
    def __init__(self, linear: Linear, num_slots: int, rank: int, mapping: LoRAMapping, use_triton: bool,
                 pool: Optional[torch.Tensor] = None, offset: int = 0):
        """pool [slots, elements]: the model's slot pool (install_lora), of which this hook's A
        and B are the columns [offset, offset + slot_elements(...)); None: a pool of its own."""
        if isinstance(linear, FusedLinear):
            self.shard_names: list[Optional[str]] = list(linear.shard_offsets)
            self.shards = list(linear.shard_offsets.values())
        else:
            self.shard_names, self.shards = [None], [(0, linear.out_features)]
        self.rank = rank
        self.mapping = mapping
        self.use_triton = use_triton
        # Tensor parallelism: adapters are sharded like their base linear. A column-parallel
        # linear (`slices`: each shard's checkpoint rows this rank holds) takes those rows of B
        # and all of A; a row-parallel one (`start`: its first input column) takes those columns
        # of A and all of B, and its partial delta is summed by the linear's own all-reduce.
        self.b_rows = {name: start for name, (start, _) in getattr(linear, "slices", {}).items()}
        self.a_cols = getattr(linear, "start", None) if hasattr(linear, "tp") else None
        a_shape = (len(self.shards) * rank, linear.in_features)
        b_shape = (linear.out_features, rank)
        if pool is None:
            pool = torch.zeros(num_slots, slot_elements(linear, rank), dtype=linear.weight.dtype,
                               device=linear.weight.device)
        self.a_span = (offset, offset + a_shape[0] * a_shape[1], a_shape)
        self.b_span = (self.a_span[1], self.a_span[1] + b_shape[0] * b_shape[1], b_shape)
        # Views into the pool: slot s's A and B are contiguous inside row s, the slot stride is
        # the pool's row (the kernels take any slot stride), so one copy fills a whole slot.
        self.lora_a = self._view(pool, self.a_span)
        self.lora_b = self._view(pool, self.b_span)

    @staticmethod
    def _view(pool: torch.Tensor, span) -> torch.Tensor:
        start, end, shape = span
        return pool[:, start:end].view(pool.shape[0], *shape)

    def slot_views(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This hook's (A, B) inside one slot's row of the pool layout (a slot, or a host image)."""
        (a0, a1, a_shape), (b0, b1, b_shape) = self.a_span, self.b_span
        return row[a0:a1].view(a_shape), row[b0:b1].view(b_shape)

    @property
    def active(self) -> bool:
        return self.mapping.active

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def write(self, slot: int, shard: Optional[str], a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Shard `shard`'s A [r, in] and B [out_shard, r] into slot `slot`, B scaled."""
        self.write_into(self.lora_a[slot], self.lora_b[slot], shard, a, b, scaling)

    def write_into(self, lora_a: torch.Tensor, lora_b: torch.Tensor, shard: Optional[str], a: torch.Tensor,
                   b: torch.Tensor, scaling: float) -> None:
        """The same into one slot's A [shards x R, in] and B [out, R] wherever they live."""
        i = self.shard_names.index(shard)
        offset, size = self.shards[i]
        r = a.shape[0]
        if self.a_cols is not None:
            a = a[:, self.a_cols:self.a_cols + lora_a.shape[1]]
        if shard in self.b_rows:
            b = b[self.b_rows[shard]:self.b_rows[shard] + size]
        lora_a[i * self.rank:i * self.rank + r].copy_(a)
        dst = lora_b[offset:offset + size, :r]
        if b.dtype == dst.dtype:
            # One pass, rounded once as b.float() * scaling would be (opmath is fp32).
            torch.mul(b, scaling, out=dst)
        else:
            dst.copy_(b.float() * scaling)

    def covered_by(self, shards: set, rank: int) -> bool:
        """Whether an adapter of `rank` on these shards of this linear writes every element of
        the linear's part of a slot (else the rest must be zeros)."""
        return rank == self.rank and set(self.shard_names) <= shards

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m = self.mapping
        if not m.active:
            return y
        if self.use_triton:
            from rooflm.kernels.lora_expand import lora_expand
            from rooflm.kernels.lora_shrink import lora_shrink
            seg = m.segments(self.lora_a.shape[0])
            h = lora_shrink(x, self.lora_a, m.token_slots, seg.token_order, seg.seg_starts, seg.seg_slots,
                            seg.max_seg_len, m.decode_only, tiles=seg.tiles)
            return lora_expand(h, self.lora_b, y, self.shards, self.rank, m.token_slots, seg.token_order,
                               seg.seg_starts, seg.seg_slots, seg.max_seg_len, m.decode_only, tiles=seg.tiles)
        if m.dense:
            return self._dense_torch(x, y, m.token_slots)
        rank = self.rank
        for slot, idx in m.groups:
            h = x[idx] @ self.lora_a[slot].T
            for i, (offset, size) in enumerate(self.shards):
                y[idx, offset:offset + size] += h[:, i * rank:(i + 1) * rank] @ self.lora_b[slot, offset:offset + size].T
        return y

    def gemv_epilogue(self, x: torch.Tensor, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6):
        """The one-token GEMV chain's form of this hook (rooflm/model/decoder.py _forward_gemv):
        the shrink of x [1, K] (normed in the kernel as the GEMV's NORM prologue normalises it,
        norm_weight given), and the expand left to the base GEMV's LORA epilogue, which adds
        the delta before the bias, activation or residual add (kernels/gemv.py LoRAEpilogue)."""
        from rooflm.kernels.gemv import LoRAEpilogue
        from rooflm.kernels.lora_shrink import lora_shrink
        m = self.mapping
        seg = m.segments(self.lora_a.shape[0])
        h = lora_shrink(x, self.lora_a, m.token_slots, seg.token_order, seg.seg_starts, seg.seg_slots,
                        seg.max_seg_len, m.decode_only, norm_weight=norm_weight, eps=eps, tiles=seg.tiles)
        out = self.lora_b.shape[1]
        shard_starts = ([offset for offset, _ in self.shards[1:]] + [out, out])[:2]
        return LoRAEpilogue(h, self.lora_b, m.token_slots, self.rank, tuple(shard_starts))

    def _dense_torch(self, x: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """The graph form on the torch path: each row gathers its slot's A and B (slot -1: a
        zero contribution), no host read of the slots, as a captured step must."""
        under = token_slots >= 0
        index = token_slots.clamp(min=0).long()
        h = torch.bmm(self.lora_a[index], x.unsqueeze(2)).squeeze(2) * under.unsqueeze(1).to(x.dtype)
        rank = self.rank
        for i, (offset, size) in enumerate(self.shards):
            b = self.lora_b[index, offset:offset + size]
            y[:, offset:offset + size] += torch.bmm(b, h[:, i * rank:(i + 1) * rank].unsqueeze(2)).squeeze(2)
        return y


def lora_targets(layer: torch.nn.Module) -> list[tuple[str, Linear]]:
    """A decoder layer's linears that adapters may target, by their names in the layer: the
    attention's qkv and o; the dense MLP's gate_up and down (an MoE block has none)."""
    attn = layer.self_attn
    targets = [("self_attn.qkv_proj", attn.qkv_proj), ("self_attn.o_proj", attn.o_proj)]
    if layer.dense_mlp:
        targets += [("mlp.gate_up_proj", layer.mlp.gate_up_proj), ("mlp.down_proj", layer.mlp.down_proj)]
    return targets


def slot_elements(linear: Linear, rank: int) -> int:
    """Elements of one slot's A and B for `linear`."""
    shards = len(linear.shard_offsets) if isinstance(linear, FusedLinear) else 1
    return shards * rank * linear.in_features + linear.out_features * rank


def install_lora(model: torch.nn.Module, mapping: LoRAMapping, num_slots: int, rank: int,
                 use_triton: bool) -> tuple[dict[tuple[int, str], LoRALinearHook], torch.Tensor]:
    """A hook on every targeted linear of every decoder layer, all reading `mapping`, their A
    and B in one slot pool [slots, elements] (a slot is one row: an adapter goes in with one
    copy); returns the hooks by (layer index, linear name), and the pool."""
    targets = []
    for index, layer in enumerate(model.model.layers):
        for name, linear in lora_targets(layer):
            if not isinstance(linear, Linear):
                raise ValueError(f"LoRA on {type(linear).__name__} (layer {index} {name}) is not served")
            targets.append((index, name, linear))
        layer.lora_mapping = mapping
    plain = sum(getattr(layer, "gemv", None) is None for layer in model.model.layers)
    if use_triton and plain:
        # The one-token GEMV chain takes the adapters in its epilogues (gemv_epilogue); a layer
        # without it (quantized base weights: the folded and FP8-code forms have no adapter
        # epilogue; --deterministic) runs one-token steps with adapters on the plain path.
        logger.info("LoRA: one-token steps with an adapter run %d of %d layers on the plain path (cuBLAS or the "
                    "quantized linear, norms and SiLU-mul apart), not the GEMV chain", plain, len(model.model.layers))
    first = targets[0][2].weight
    total = sum(slot_elements(linear, rank) for _, _, linear in targets)
    pool = torch.zeros(num_slots, total, dtype=first.dtype, device=first.device)
    hooks, offset = {}, 0
    for index, name, linear in targets:
        hook = LoRALinearHook(linear, num_slots, rank, mapping, use_triton, pool=pool, offset=offset)
        offset += slot_elements(linear, rank)
        linear.lora = hook
        hooks[(index, name)] = hook
    return hooks, pool
