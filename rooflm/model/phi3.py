"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): the Llama layer with RoPE over the first
partial_rotary_factor of each head (Phi-4-mini: 96 of 128 dims), LongRoPE scaling (per-frequency
short and long factors and an attention factor on cos/sin, layers/rotary.py), a window on every
layer where config.json sets sliding_window, and checkpoints that store q|k|v as one
self_attn.qkv_proj tensor and gate|up as one mlp.gate_up_proj: rooflm's fused linears hold the
same rows in the same order, so checkpoint_tensors cuts them into the Llama names that load
into those shards (one rank's rows of each shard under tensor parallelism, as for any checkpoint).
"""

from __future__ import annotations

from typing import Any, Iterator

import dataclasses
import math

from rooflm.config import ModelConfig, RopeScaling
from rooflm.layers.rotary import Rope, longrope_attention_factor
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, GGUFLayout, GGUFMetadata
from rooflm.model.spec import ModelSpec, layer_windows, rotary_dim

ARCHITECTURE = "Phi3ForCausalLM"
MODEL_TYPE = "phi3"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the ModelConfig fields Phi-3 adds (the loader reads its LongRoPE, with the
    top-level original_max_position_embeddings HF prefers)."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Phi-3 with hidden_act {act!r}: rooflm runs silu")
    parameters = raw.get("rope_parameters") or {}
    factor = raw.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0))
    window = raw.get("sliding_window")
    return dict(partial_rotary_factor=float(factor), sliding_window=None if window is None else int(window))


def spec(cfg: ModelConfig) -> ModelSpec:
    rope = Rope(cfg.rope_theta, cfg.rope_scaling, rotary_dim(cfg))
    return ModelSpec(layer_windows=layer_windows(cfg), layer_ropes=(rope,) * cfg.num_hidden_layers)


def checkpoint_tensors(cfg: ModelConfig, name: str, tensor) -> Iterator[tuple[str, Any]]:
    """A fused qkv_proj / gate_up_proj checkpoint tensor -> its q, k, v / gate, up rows under
    the Llama names; any other tensor as it is."""
    prefix, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):  # e.g. GPTQ's packed qweight: not cut here, refused by name
        yield name, tensor
        return
    if prefix.endswith(".self_attn.qkv_proj"):
        base = prefix[: -len("qkv_proj")]
        sizes = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size}
    elif prefix.endswith(".mlp.gate_up_proj"):
        base = prefix[: -len("gate_up_proj")]
        sizes = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    else:
        yield name, tensor
        return
    if tensor.shape[0] != sum(sizes.values()):
        raise ValueError(f"tensor {name!r} has {tensor.shape[0]} rows; the config implies "
                         f"{' + '.join(str(s) for s in sizes.values())}")
    start = 0
    for part, size in sizes.items():
        yield f"{base}{part}.{kind}", Rows(tensor, start, size)
        start += size


class Rows:
    """Rows [start, start + size) of a checkpoint tensor or a lazy slice (model/loader.LazySlice),
    read only when asked: a tensor-parallel rank narrows it further to its own rows."""

    def __new__(cls, tensor, start: int, size: int):
        if hasattr(tensor, "narrow") and not hasattr(tensor, "load"):  # a torch tensor: a view
            return tensor.narrow(0, start, size)
        return super().__new__(cls)

    def __init__(self, tensor, start: int, size: int):
        self._tensor, self._start = tensor, start
        self.shape = (size,) + tuple(tensor.shape[1:])

    def narrow(self, dim: int, start: int, size: int):
        if dim == 0:
            return self._tensor.narrow(0, self._start + start, size)
        return self.load().narrow(dim, start, size)

    def load(self):
        return self._tensor.narrow(0, self._start, self.shape[0])


class Phi3ForCausalLM(CausalLM):
    spec_of = staticmethod(spec)


# GGUF, as llama.cpp's converter writes Phi-3: attn_qkv and ffn_up (gate then up) fused as in the
# HF checkpoint, q/k unpermuted (NEOX rotary), the rotated width as rope.dimension_count, and
# LongRoPE as two factor tensors with the attention factor in the metadata.
def gguf_fused(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    return {"attn_qkv": (("self_attn.q_proj", cfg.q_size), ("self_attn.k_proj", cfg.kv_size),
                         ("self_attn.v_proj", cfg.kv_size)),
            "ffn_up": (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size))}


def gguf_config(gguf: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """Partial rotary from rope.dimension_count, the window (0: none, Phi-4's), LongRoPE from
    rope_factors_short/long: the extension factor is the context over the original one, and the
    attention factor the file's (kept as None where it is LongRoPE's default, which HF computes)."""
    head_dim = fields["head_dim"]
    window = int(gguf.arch_field("attention.sliding_window", 0) or 0)
    out = dict(partial_rotary_factor=int(gguf.arch_field("rope.dimension_count", head_dim)) / head_dim,
               sliding_window=window or None)
    if ROPE_FACTORS_LONG not in gguf.tensors:
        return out
    original = int(gguf.required_arch_field("rope.scaling.original_context_length"))
    scaling = RopeScaling("longrope", factor=fields["max_position_embeddings"] / original,
                          original_max_position_embeddings=original,
                          short_factor=tuple(gguf.float_tensor(ROPE_FACTORS_SHORT).tolist()),
                          long_factor=tuple(gguf.float_tensor(ROPE_FACTORS_LONG).tolist()))
    stored = gguf.arch_field("rope.scaling.attn_factor")
    if stored is not None and not math.isclose(float(stored), longrope_attention_factor(scaling), rel_tol=1e-6):
        scaling = dataclasses.replace(scaling, attention_factor=float(stored))
    out["rope_scaling"] = scaling
    return out


GGUF = GGUFLayout("phi3", fused=gguf_fused, config_fields=gguf_config)
