"""Granite 3 (GraniteForCausalLM): the Llama layer with muP's four multipliers from
config.json: the embedding times embedding_multiplier, each sublayer's output times
residual_multiplier before its residual add, attention scores scaled by attention_multiplier
(in place of 1/sqrt(head_dim)), and the logits divided by logits_scaling. Checkpoint names
are Llama's.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata
from rooflm.model.spec import ModelSpec, layer_windows

ARCHITECTURE = "GraniteForCausalLM"
MODEL_TYPE = "granite"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the multipliers (HF's GraniteConfig defaults: 1.0, no change)."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Granite with hidden_act {act!r}: rooflm runs silu")
    return dict(
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
    )


def spec(cfg: ModelConfig) -> ModelSpec:
    def unless_one(x: float):
        return None if x == 1.0 else x

    return ModelSpec(
        attn_scale=cfg.attention_multiplier,
        embed_scale=unless_one(cfg.embedding_multiplier),
        residual_scale=unless_one(cfg.residual_multiplier),
        logit_divisor=unless_one(cfg.logits_scaling),
        layer_windows=layer_windows(cfg),
    )


class GraniteForCausalLM(CausalLM):
    spec_of = staticmethod(spec)


def gguf_config(gguf: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """The multipliers under llama.cpp's names (embedding_scale, residual_scale, attention.scale,
    logit_scale); absent, each leaves the model as a Llama (an absent attention.scale is
    1/sqrt(head_dim) in llama.cpp)."""
    scale = gguf.arch_field("attention.scale")
    return dict(
        embedding_multiplier=float(gguf.arch_field("embedding_scale", 1.0)),
        residual_multiplier=float(gguf.arch_field("residual_scale", 1.0)),
        attention_multiplier=None if scale is None else float(scale),
        logits_scaling=float(gguf.arch_field("logit_scale", 1.0)),
    )


# GGUF: llama.cpp converts Granite as a Llama (q/k permuted), its multipliers in the metadata.
GGUF = GGUFLayout("granite", rotary_permuted=True, config_fields=gguf_config)
