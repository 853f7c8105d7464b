"""The whole Llama-family decoder in one C call (csrc/decode_layer.c) for one sequence on the
CPU: a batch-1 decode step or one prefill chunk.

Why: with the matmuls already in C (block_matmul.c), SmolLM2-135M's decode step on 2 cores
still spent ~14-18 ms of ~24 in the ~20 torch ops a layer around them (norms, rotary, casts,
the cache write, SDPA), each a few microseconds of dispatch for nanoseconds of arithmetic,
times 30 layers. Here the 30 layers are one ctypes call; the embedding lookup before it and
the LM head after it stay where they were.

Where it applies (`NativeDecoder.build` checks once per model; `forward` once per step, and
returns None to send the step down the torch path):
  - the model: on the CPU in float32, every decoder linear a NativeBlockLinear (GGUF
    Q4_0/Q4_1/Q8_0 blocks kept quantized, native kernels built) without bias, no per-head q/k
    norm, neox rotary, one device (no tensor parallelism), no fused-GEMV or deterministic linear
    kernels; ROOFLM_NATIVE_DECODE=0 turns it off;
  - the step: one sequence (a decode, or a prefill chunk: C calls of <= MAX_CHUNK tokens), a float32
    (not FP8) KV cache, every slot valid, no sliding window shorter than the context.
Everything else takes the torch path. The K/V go into the engine's own paged pool, through the
step's slot mapping and block table, so prefix caching, copy-on-write and preemption are
unchanged.

The math is the torch path's in fp32 and the matmuls are the same C kernel with the same
activation quantization; norms, softmax and SiLU are summed in another order, so hidden states
and logits agree to better than 1e-4 relative rather than bit for bit, and greedy tokens are the
same (tests/unit/test_native_decode.py). Threads: torch.get_num_threads(), in one OpenMP
parallel region per call with four barriers a layer (csrc/decode_layer.c says why).
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
                ("gate_up", _BlockWeight), ("down", _BlockWeight), ("k_cache", _P), ("v_cache", _P)]


class _DecoderShape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("num_layers", _I64),
                ("eps", _F), ("scale", _F), ("cos_sin", _P), ("final_norm", _P)]


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
        if not getattr(layer, "native_form", True):  # model/decoder.py's parts: post-norms, soft-caps, ...
            return f"layer {i} has parts the C decoder does not compute"
        attn = layer.self_attn
        if attn.cfg.qk_norm:
            return "per-head q/k norms"
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
        if layer.input_layernorm.kernel is not None or layer.mlp.act.kernel is not None:
            return "custom norm/activation kernels"
    return None


class NativeDecoder:
    """Owns the C-side description of a LlamaModel's layers (pointers packed once) and runs
    eligible steps through rl_decoder_forward."""

    def __init__(self, model):
        self.model = model
        self.lib = native.library()
        layer0 = model.layers[0]
        cfg = layer0.self_attn.cfg
        self.cfg = cfg
        self.sliding_window = cfg.sliding_window
        rotary = layer0.self_attn.attn.rotary
        self._cos_sin = rotary.cos_sin_cache.float().contiguous()  # kept alive: C reads it
        self.max_positions = self._cos_sin.shape[0]
        self.shape = _DecoderShape(
            hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, block_size=0,
            num_layers=len(model.layers), eps=layer0.input_layernorm.eps, scale=layer0.self_attn.attn.scale,
            cos_sin=self._cos_sin.data_ptr(), final_norm=model.norm.weight.data_ptr())
        self.layers = (_DecoderLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers[i] = _DecoderLayer(
                ln1=layer.input_layernorm.weight.data_ptr(), ln2=layer.post_attention_layernorm.weight.data_ptr(),
                qkv=_block_weight(attn.qkv_proj), o=_block_weight(attn.o_proj),
                gate_up=_block_weight(mlp.gate_up_proj), down=_block_weight(mlp.down_proj))
        self._bound: Optional[list] = None  # the (K, V) pools the layer table points at
        self._shape_ptr = ctypes.byref(self.shape)

    @classmethod
    def build(cls, model) -> Optional["NativeDecoder"]:
        reason = unsupported_reason(model)
        if reason is not None:
            log.info("decoder path: torch (native decoder off: %s)", reason)
            return None
        log.info("decoder path: native C decoder (rooflm/quant/csrc/decode_layer.c) for single-sequence CPU steps")
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
        self._bound = [(c.k, c.v) for c in kv_caches]
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> Optional[torch.Tensor]:
        """The final normed hidden states [T, hidden], or None: the step takes the torch path."""
        tokens = input_ids.shape[0]
        if meta.num_seqs != 1 or tokens == 0 or input_ids.dim() != 1 or meta.groups:
            return None  # KV cache groups: the C decoder reads one block table for every layer
        seq_len = meta.seq_lens_cpu[0]
        if self.sliding_window is not None and seq_len > self.sliding_window:
            return None
        if seq_len > self.max_positions or not self._bind_cache(kv_caches):
            return None
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or (slots.min() if tokens > 1 else slots[0]) < 0:
            return None
        slots = slots.contiguous()  # held here: the C call reads it
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        block_table = meta.block_tables[0]
        if block_table.dtype != torch.int32 or not block_table.is_contiguous():
            block_table = block_table.to(torch.int32).contiguous()
        x = self.model.embed_tokens(input_ids)
        if not x.is_contiguous() or x.dtype != torch.float32:
            x = x.float().contiguous()
        threads = torch.get_num_threads()
        for start in range(0, tokens, MAX_CHUNK):
            count = min(MAX_CHUNK, tokens - start)
            # Row offsets into x, positions and slots: 4 or 8 bytes an element.
            status = self.lib.rl_decoder_forward(
                self._shape_ptr, self.layers, x[start].data_ptr(), count, positions[start].data_ptr(),
                slots[start].data_ptr(), block_table.data_ptr(), threads)
            if status != 0:
                raise MemoryError(f"native decoder could not allocate its buffers for {count} tokens")
        return x
