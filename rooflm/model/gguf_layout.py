"""How llama.cpp's convert_hf_to_gguf.py lays out a family's GGUF files: the type a family's
registry entry (registry.Family.gguf) fills in, and the helpers its metadata reader shares.
model/gguf_loader.py reads files by it; this module imports neither, so family files can.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

import numpy as np

from rooflm.config import ModelConfig

# Phi-3's LongRoPE per-frequency factors: config, read into the RopeScaling (phi3.gguf_config).
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"


class GGUFMetadata(Protocol):
    """What a family's metadata reader sees of a file (gguf_loader.GGUFFile)."""

    tensors: Mapping[str, Any]

    def arch_field(self, key: str, default: Any = None) -> Any: ...

    def required_arch_field(self, key: str) -> Any: ...

    def float_tensor(self, name: str) -> np.ndarray: ...


def no_gguf_fields(gguf_file: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp's convert_hf_to_gguf.py writes one family's checkpoints."""

    architecture: str  # general.architecture
    # attn_q / attn_k rows permuted into llama.cpp's interleaved rotary layout (its LlamaModel
    # subclasses: Llama, Mistral, Granite, SmolLM3); undone on load.
    rotary_permuted: bool = False
    # blk.N.<GGUF module> -> model.layers.N.<HF module>, over (and in place of) LAYER_MODULE_NAMES.
    layer_tensors: Mapping[str, str] = field(default_factory=dict)
    # config -> {GGUF module: ((HF module, rows), ...)}: a tensor holding several HF ones, row
    # blocks in that order (Phi-3's attn_qkv; its ffn_up, gate then up).
    fused: Optional[Callable[[ModelConfig], dict[str, tuple[tuple[str, int], ...]]]] = None
    # What the converter added to every norm weight (Gemma stores g = 1 + w): subtracted on load, so
    # the family's (1 + w) norm, and its fused paths, apply g again. In fp32 g - 1 and 1 + (g - 1)
    # are both exact for any g >= 0.5 (Sterbenz below 1), so the scale is the file's bit for bit;
    # a plain w * norm(x) part would instead round in Llama's order, not Gemma's, in half precision.
    norm_offset: float = 0.0
    # (the file, the fields every family reads) -> the ModelConfig fields this family adds or
    # replaces, from its metadata keys (or llama.cpp's hard-coded values where it writes none).
    config_fields: Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]] = no_gguf_fields
    # The architecture string's mixture-of-experts variant: the family a file of that string with
    # `<arch>.expert_count` > 0 is (llama.cpp writes Mixtral as "llama" with experts).
    moe: bool = False


def moe_gguf_fields(gguf_file: GGUFMetadata, num_layers: int, norm_topk_prob: bool) -> dict[str, Any]:
    """The ModelConfig MoE fields from llama.cpp's keys: expert_count, expert_used_count,
    expert_feed_forward_length (absent for Mixtral, whose experts are feed_forward_length wide),
    expert_weights_norm where the file has it (else the family's rule: llama.cpp's graph
    renormalises Qwen3-MoE's and Mixtral's top-k weights), expert_shared_feed_forward_length
    (Qwen2-MoE's shared expert). Which layers are sparse is which have a router tensor
    (blk.N.ffn_gate_inp), written as HF writes it: decoder_sparse_step where the sparse layers are
    every step-th one, else mlp_only_layers."""
    sparse = {i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in gguf_file.tensors}
    step = next((s for s in range(1, num_layers + 1) if sparse == {i for i in range(num_layers) if (i + 1) % s == 0}),
                None)
    return dict(num_experts=int(gguf_file.required_arch_field("expert_count")),
                num_experts_per_tok=int(gguf_file.required_arch_field("expert_used_count")),
                moe_intermediate_size=int(gguf_file.arch_field("expert_feed_forward_length", 0) or 0),
                norm_topk_prob=bool(gguf_file.arch_field("expert_weights_norm", norm_topk_prob)),
                shared_expert_intermediate_size=int(gguf_file.arch_field("expert_shared_feed_forward_length", 0) or 0),
                decoder_sparse_step=step or 1,
                mlp_only_layers=() if step else tuple(i for i in range(num_layers) if i not in sparse))


def swa_layer_types(gguf_file: GGUFMetadata, num_layers: int, period: int) -> tuple[str, ...]:
    """Each layer's HF layer type, by llama.cpp's rule: attention.sliding_window_pattern where the
    file has it (a period, or one flag a layer), else the family's period, whose last layer in
    each period is global (Gemma 2: 2, Gemma 3: 6, OLMo 3: 4; llama.cpp hard-codes them)."""
    pattern = gguf_file.arch_field("attention.sliding_window_pattern", period)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ValueError(f"attention.sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(num_layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)
