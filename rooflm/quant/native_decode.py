"""The whole decoder in one C call (csrc/decode_layer.c) for a CPU step: decode rows of B
sequences (each its own sequence and KV length), prefill chunks, or both in one step. The
Llama layer and the parts other families add to it (post-norms, (1 + w) norms, per-head q/k
norms, GELU-tanh, residual scales, per-layer rotaries and windows: ModelSpec.native_reason says
what it cannot take).

Why batched: a decode step on the CPU is bound by reading the weights (SmolLM2-135M's ~100 MB of
Q4/Q8 blocks a step); the C matmul reads each weight block once for all B rows, so B streams cost
about one weight read a step, where the torch path's per-op dispatch grew with B and 4 streams
made fewer tokens/s than one (issue 51).

Why: with the matmuls already in C (block_matmul.c), SmolLM2-135M's decode step on 2 cores
still spent ~14-18 ms of ~24 in the ~20 torch ops a layer around them (norms, rotary, casts,
the cache write, SDPA), each a few microseconds of dispatch for nanoseconds of arithmetic,
times 30 layers. Here the 30 layers are one ctypes call; the embedding lookup before it and
the LM head after it stay where they were.

Where it applies (`NativeDecoder.build` checks once per model; `forward` once per step, and
returns None to send the step down the torch path):
  - the model: on the CPU in float32, every decoder linear a NativeBlockLinear (GGUF
    Q4_0/Q4_1/Q8_0 blocks kept quantized, native kernels built) without bias, neox rotary, one
    device (no tensor parallelism), no fused-GEMV or deterministic linear kernels;
    ROOFLM_NATIVE_DECODE=0 turns it off;
  - the step: any mix of decode rows and prefill chunks (C calls of <= MAX_CHUNK tokens, a
    sequence's run cut between calls where it crosses one), a float32 (not FP8) KV cache, every
    slot valid; with KV cache groups, each layer reads its group's slots and block tables.
Everything else takes the torch path. The K/V go into the engine's own paged pool, through the
step's slot mapping and block table, so prefix caching, copy-on-write and preemption are
unchanged.

The math is the torch path's in fp32 and the matmuls are the same C kernel with the same
activation quantization; norms, softmax and SiLU are summed in another order, so hidden states
and logits agree to better than 1e-4 relative rather than bit for bit, and greedy tokens are the
same (tests/unit/test_native_decode.py). A row's result does not depend on the rows beside it
(each output is one weight row's dot product with one token, summed in the same order whatever B;
attention is per sequence), so a batched step gives each sequence the bits its own step would.
Threads: torch.get_num_threads(), in one OpenMP parallel region per call with five yielding
barriers a layer (seven with post-norms), batched or not (csrc/decode_layer.c says why).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

import rooflm.envs as envs
from rooflm.quant import native
from rooflm.quant.linear_method import NativeBlockLinear

log = logging.getLogger(__name__)

ENV_SWITCH = "ROOFLM_NATIVE_DECODE"
# Tokens per C call: a call allocates its activations ([T, 2 x intermediate] floats and the
# like) and per-thread quantized copies of them; a longer step is cut into calls of this many
# consecutive tokens (each later one reads the earlier ones' K/V from the cache).
MAX_CHUNK = 512

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _BlockWeight(ctypes.Structure):
    _fields_ = [("codes", _P), ("scale", _P), ("offset", _P), ("n", _I64), ("k", _I64)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("ln1", _P), ("ln2", _P), ("qkv", _BlockWeight), ("o", _BlockWeight),
                ("gate_up", _BlockWeight), ("down", _BlockWeight), ("k_cache", _P), ("v_cache", _P),
                ("post1", _P), ("post2", _P), ("q_norm", _P), ("k_norm", _P), ("cos_sin", _P),
                ("rot_dim", _I64), ("window", _I64), ("group", _I64)]


class _DecoderShape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("num_layers", _I64),
                ("eps", _F), ("scale", _F), ("final_norm", _P), ("gelu_tanh", _I64), ("residual_scale", _F)]


def _table(rotary, held: list) -> Optional[torch.Tensor]:
    """A layer's rotary table as the C side reads it ([max_positions, rot_dim] fp32), or None for
    a layer without RoPE."""
    table = getattr(rotary, "cos_sin_cache", None)
    if table is None:
        return None
    table = table.float().contiguous()
    held.append(table)
    return table


def enabled() -> bool:
    return envs.get(ENV_SWITCH)


def _block_weight(linear) -> Optional[_BlockWeight]:
    """The C view of a Linear's quantized weight, or None where the native decoder can't take it."""
    quant = getattr(linear, "quant", None)
    if not isinstance(quant, NativeBlockLinear) or linear.bias is not None or linear.kernel is not None:
        return None
    offset = 0 if quant.offset is None else quant.offset.data_ptr()
    return _BlockWeight(quant.codes.data_ptr(), quant.scale.data_ptr(), offset or None,
                        quant.out_features, quant.in_features)


def unsupported_reason(model) -> Optional[str]:
    """Why `model` (a DecoderModel) can't run natively, or None when it can."""
    if not enabled():
        return f"{ENV_SWITCH}=0"
    embed = model.embed_tokens.weight
    if embed.device.type != "cpu" or embed.dtype != torch.float32:
        return f"model on {embed.device.type} in {embed.dtype}, not the CPU in float32"
    if native.library() is None:  # after the device check: a GPU host never builds it
        return "native CPU kernels not built"
    for i, layer in enumerate(model.layers):
        if layer.native_reason is not None:  # a part the C decoder does not compute (ModelSpec.native_reason)
            return f"layer {i}: {layer.native_reason}"
        attn = layer.self_attn
        if not getattr(attn.attn.rotary, "is_neox", True):
            return "interleaved rotary"
        if attn.heads.num_heads != attn.cfg.num_attention_heads:
            return "tensor parallelism"
        if layer.gemv is not None:
            return "fused GEMV kernels"
        for name, linear in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            if _block_weight(linear) is None:
                return f"layer {i} {name} is not a native block-quantized linear without bias"
        if layer.pre_attn.kernel is not None or getattr(layer.mlp.act, "kernel", None) is not None:
            return "custom norm/activation kernels"
    return None


class NativeDecoder:
    """Owns the C-side description of a DecoderModel's layers (pointers packed once) and runs
    eligible steps through rl_decoder_forward."""

    def __init__(self, model):
        self.model = model
        self.lib = native.library()
        layer0 = model.layers[0]
        cfg = layer0.self_attn.cfg
        self.cfg = cfg
        self._held = []  # tensors the C side reads: kept alive as long as the layer table
        tables = [_table(layer.self_attn.attn.rotary, self._held) for layer in model.layers]
        # Positions past a rotary table's end take the torch path (which would fail the same way).
        self.max_positions = min((t.shape[0] for t in tables if t is not None), default=1 << 62)
        residual_scale = layer0.residual_scale
        self.shape = _DecoderShape(
            hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, block_size=0,
            num_layers=len(model.layers), eps=layer0.pre_attn.eps, scale=layer0.self_attn.attn.scale,
            final_norm=self._fp32(model.norm.fused_weight), gelu_tanh=int(not layer0.mlp.silu),
            residual_scale=1.0 if residual_scale is None else residual_scale)
        self.layers = (_DecoderLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = [None if n is None else self._fp32(n.fused_weight)
                     for n in (layer.pre_attn, layer.pre_mlp, layer.post_attn, layer.post_mlp)]
            q_norm = getattr(attn, "q_norm", None)
            table = tables[i]
            self.layers[i] = _DecoderLayer(
                ln1=norms[0], ln2=norms[1], post1=norms[2], post2=norms[3],
                q_norm=None if q_norm is None else self._fp32(q_norm.fused_weight),
                k_norm=None if q_norm is None else self._fp32(attn.k_norm.fused_weight),
                cos_sin=None if table is None else table.data_ptr(),
                rot_dim=0 if table is None else table.shape[1], window=attn.attn.sliding_window or 0,
                qkv=_block_weight(attn.qkv_proj), o=_block_weight(attn.o_proj),
                gate_up=_block_weight(mlp.gate_up_proj), down=_block_weight(mlp.down_proj))
        self._bound: Optional[list] = None  # the (K, V) pools the layer table points at
        self._shape_ptr = ctypes.byref(self.shape)

    def _fp32(self, weight: torch.Tensor) -> int:
        """The address of weight as a contiguous fp32 tensor the C side can read (held)."""
        weight = weight.detach().float().contiguous()
        self._held.append(weight)
        return weight.data_ptr()

    @classmethod
    def build(cls, model) -> Optional["NativeDecoder"]:
        reason = unsupported_reason(model)
        if reason is not None:
            log.info("decoder path: torch (native decoder off: %s)", reason)
            return None
        log.info("decoder path: native C decoder (rooflm/quant/csrc/decode_layer.c) for CPU decode and prefill steps")
        return cls(model)

    def _bind_cache(self, kv_caches) -> bool:
        """Point the layer table at this step's K/V pools (the engine's are the same tensors
        every step, so the table is filled once); False when the cache is one the C code does not
        read (FP8, not fp32). The bound tensors are held: a freed pool's address could otherwise
        come back as another tensor's, and the C side would write through a stale pointer."""
        bound = self._bound
        if bound is not None and len(bound) == len(kv_caches) and all(
                c.k is k and c.v is v for c, (k, v) in zip(kv_caches, bound)):
            return True
        for cache in kv_caches:
            if cache.k_scale is not None or cache.k.dtype != torch.float32 or not (
                    cache.k.is_contiguous() and cache.v.is_contiguous()):
                return False
        first = kv_caches[0]
        heads, dim = first.k.shape[2:]
        if (heads, dim) != (self.cfg.num_key_value_heads, self.cfg.head_dim) or len(kv_caches) != len(self.layers):
            return False
        self.shape.block_size = first.k.shape[1]
        for i, cache in enumerate(kv_caches):
            self.layers[i].k_cache = cache.k.data_ptr()
            self.layers[i].v_cache = cache.v.data_ptr()
            self.layers[i].group = getattr(cache, "group", 0)
        self._bound = [(c.k, c.v) for c in kv_caches]
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> Optional[torch.Tensor]:
        """The final normed hidden states [T, hidden], or None: the step takes the torch path."""
        tokens = input_ids.shape[0]
        loc = meta.query_start_loc_cpu
        if tokens == 0 or input_ids.dim() != 1 or loc[-1] != tokens:
            return None
        if max(meta.seq_lens_cpu) > self.max_positions or not self._bind_cache(kv_caches):
            return None
        # Each KV cache group's slots and block tables (one group: the step's own), held here
        # while the C call reads them.
        views = [meta] + list(meta.groups or [])
        slot_groups, table_groups = [], []
        for view in views:
            slots = view.slot_mapping
            if slots.dtype != torch.int64 or (slots.min() if tokens > 1 else slots[0]) < 0:
                return None
            table = view.block_tables
            if table.dtype != torch.int32 or not table.is_contiguous():
                table = table.to(torch.int32).contiguous()
            slot_groups.append(slots.contiguous())
            table_groups.append(table)
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        x = self.model.embed_tokens(input_ids)
        if self.model.embed_scale is not None:
            x = x * self.model.embed_scale
        if not x.is_contiguous() or x.dtype != torch.float32:
            x = x.float().contiguous()
        threads = torch.get_num_threads()
        tables = (_P * len(views))(*[t.data_ptr() for t in table_groups])
        widths = (_I64 * len(views))(*[t.shape[1] for t in table_groups])
        for start in range(0, tokens, MAX_CHUNK):
            count = min(MAX_CHUNK, tokens - start)
            rows, starts = sequence_runs(loc, start, start + count)
            # Row offsets into x, positions and each group's slots (8 bytes an int64 slot).
            slots = (_P * len(views))(*[s.data_ptr() + start * 8 for s in slot_groups])
            status = self.lib.rl_decoder_forward(
                self._shape_ptr, self.layers, x[start].data_ptr(), count, positions[start].data_ptr(),
                slots, tables, widths, len(rows), (_I64 * len(starts))(*starts), (_I64 * len(rows))(*rows),
                threads)
            if status != 0:
                raise MemoryError(f"native decoder could not allocate its buffers for {count} tokens")
        return x


def sequence_runs(query_start_loc: list[int], start: int, end: int) -> tuple[list[int], list[int]]:
    """The sequences with tokens among the step's tokens [start, end) (one C call's): their rows
    in the block tables, and their runs' bounds counted from start ([0, ..., end - start])."""
    rows, starts = [], [0]
    for row in range(len(query_start_loc) - 1):
        first, last = max(query_start_loc[row], start), min(query_start_loc[row + 1], end)
        if first < last:
            rows.append(row)
            starts.append(last - start)
    return rows, starts
