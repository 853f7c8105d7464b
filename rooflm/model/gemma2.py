"""Gemma 2 (Gemma2ForCausalLM): norms before and after each sublayer, all (1 + w) RMSNorms;
the embedding scaled by sqrt(hidden_size); a GELU-tanh gated MLP; attention scores scaled by
1/sqrt(query_pre_attn_scalar) and soft-capped, and the logits soft-capped; sliding-window
and global layers alternating (layer_types); the LM head tied to the embedding.
"""

from __future__ import annotations

import math
from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata, swa_layer_types
from rooflm.model.spec import GELU_TANH, RMS_ONE_PLUS, ModelSpec, layer_windows

ARCHITECTURE = "Gemma2ForCausalLM"
MODEL_TYPE = "gemma2"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the ModelConfig fields Gemma 2 adds (HF's defaults where absent)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 2 with hidden_activation {act!r}: rooflm runs gelu_pytorch_tanh")
    layers = int(raw["num_hidden_layers"])
    # HF's default when config.json has no layer_types: even layers slide, odd ones are global.
    layer_types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(layers)]
    return dict(
        hidden_act="gelu_pytorch_tanh",
        layer_types=tuple(layer_types),
        sliding_window=int(raw.get("sliding_window") or 4096),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping", 30.0)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def spec(cfg: ModelConfig) -> ModelSpec:
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
    return ModelSpec(
        pre_attn_norm="input_layernorm",
        post_attn_norm="post_attention_layernorm",
        pre_mlp_norm="pre_feedforward_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        norm=RMS_ONE_PLUS,
        attn_scale=scalar ** -0.5,
        attn_softcap=cfg.attn_logit_softcapping,
        final_softcap=cfg.final_logit_softcapping,
        layer_windows=layer_windows(cfg),
        embed_scale=math.sqrt(cfg.hidden_size),
        mlp_act=GELU_TANH,
    )


class Gemma2ForCausalLM(CausalLM):
    spec_of = staticmethod(spec)


def _optional_float(value: Any):
    return None if value is None else float(value)


# GGUF, as llama.cpp's converter writes Gemma 2 and 3: the sandwich norms under their own names
# (the pre-MLP norm is ffn_norm), every norm weight stored as 1 + w, q/k unpermuted (NEOX rotary).
GEMMA_GGUF_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_query_pre_attn_scalar(fields: dict[str, Any], largest_model_layers: int) -> float:
    """The converter writes no query_pre_attn_scalar; llama.cpp takes hidden/heads for the 27B
    model (told apart by its layer count) and head_dim for the others, what each config.json sets."""
    if fields["num_hidden_layers"] == largest_model_layers:
        return float(fields["hidden_size"] // fields["num_attention_heads"])
    return float(fields["head_dim"])


def gguf_config(gguf: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's metadata: the window and both soft-caps (llama.cpp's defaults, HF's, where
    absent); its rotary base is not written (10000, every Gemma 2's); even layers slide."""
    return dict(
        hidden_act="gelu_pytorch_tanh",
        layer_types=swa_layer_types(gguf, fields["num_hidden_layers"], period=2),
        sliding_window=int(gguf.required_arch_field("attention.sliding_window")),
        query_pre_attn_scalar=gguf_query_pre_attn_scalar(fields, largest_model_layers=46),
        attn_logit_softcapping=float(gguf.arch_field("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(gguf.arch_field("final_logit_softcapping", 30.0)),
    )


GGUF = GGUFLayout("gemma2", layer_tensors=GEMMA_GGUF_TENSORS, norm_offset=1.0, config_fields=gguf_config)
