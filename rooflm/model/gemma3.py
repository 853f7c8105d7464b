"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's layer (norms before and
after each sublayer, all (1 + w) RMSNorms, a GELU-tanh gated MLP, the embedding scaled by
sqrt(hidden_size), scores scaled by 1/sqrt(query_pre_attn_scalar), the LM head tied) with
(1 + w) RMSNorms over each q and k head, five sliding-window layers to each global one, and
two RoPE bases: rope_local_base_freq on the sliding layers, rope_theta (with its linear
scaling, 8x on the 4B-27B models) on the global ones. No attention soft-cap: HF's Gemma 3
never applies attn_logit_softcapping, so neither does rooflm; the final soft-cap is applied
where config.json sets one. A Gemma3ForConditionalGeneration directory (4B-27B) runs as its
text model: its text_config and language_model.* tensors.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

from rooflm.config import ModelConfig
from rooflm.layers.rotary import Rope, rope_scaling_from_hf
from rooflm.model.decoder import CausalLM
from rooflm.model.gemma2 import GEMMA_GGUF_TENSORS, gguf_query_pre_attn_scalar
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata, swa_layer_types
from rooflm.model.spec import GELU_TANH, QK_NORM_HEAD, RMS_ONE_PLUS, ModelSpec, layer_windows

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
# The 4B-27B checkpoints: the same text model beside a vision tower, under language_model.*.
MULTIMODAL_ARCHITECTURE = "Gemma3ForConditionalGeneration"
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the ModelConfig fields Gemma 3 adds (HF's Gemma3TextConfig defaults)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 with hidden_activation {act!r}: rooflm runs gelu_pytorch_tanh")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder): rooflm runs causal decoders")
    layers = int(raw["num_hidden_layers"])
    pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
    layer_types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                             for i in range(layers)]
    # transformers >= 5 writes rope_parameters per layer type; older config.json files write
    # rope_theta, rope_local_base_freq and the global layers' rope_scaling.
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    sliding = params.get("sliding_attention") or {}
    max_positions = int(raw.get("max_position_embeddings", 131072))
    scaling = raw.get("rope_scaling") or full
    local_scaling = rope_scaling_from_hf(sliding, max_positions)
    if local_scaling is not None:
        raise ValueError(f"Gemma 3 with {local_scaling.rope_type} scaling on its sliding layers: rooflm "
                         f"scales the global layers' RoPE only")
    return dict(
        hidden_act="gelu_pytorch_tanh",
        layer_types=tuple(layer_types),
        sliding_window=int(raw.get("sliding_window") or 4096),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        rope_theta=float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        rope_scaling=rope_scaling_from_hf(scaling, max_positions),
        rope_local_theta=float(sliding.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
    )


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json -> its text model's, as a Gemma3ForCausalLM
    config.json: rooflm serves the text model (images are not an input it takes)."""
    text = dict(raw.get("text_config") or {})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "quantization_config"):
        if key not in text and key in raw:
            text[key] = raw[key]
    # Gemma3TextConfig's defaults, for the keys a sparse export leaves out.
    for key, value in dict(vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                           rms_norm_eps=1e-6, max_position_embeddings=131072).items():
        text.setdefault(key, value)
    # HF's Gemma3ForConditionalGeneration never soft-caps its logits (its Gemma3ForCausalLM does,
    # where set; no published Gemma 3 sets it): the multimodal model's logits are the reference.
    text["final_logit_softcapping"] = None
    text["architectures"] = [ARCHITECTURE]
    return text


def checkpoint_tensors(cfg: ModelConfig, name: str, tensor) -> Iterator[tuple[str, Any]]:
    """A multimodal checkpoint's text tensors under the text model's names; its vision tower and
    projector left out. A text-only checkpoint's names pass as they are."""
    if name.startswith(_VISION_PREFIXES):
        return
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            name = "model." + name[len(prefix):]
    if name == "language_model.lm_head.weight":
        name = "lm_head.weight"
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return
    yield name, tensor


def spec(cfg: ModelConfig) -> ModelSpec:
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
    local = Rope(cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta)
    windows = layer_windows(cfg)
    return ModelSpec(
        pre_attn_norm="input_layernorm",
        post_attn_norm="post_attention_layernorm",
        pre_mlp_norm="pre_feedforward_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        norm=RMS_ONE_PLUS,
        qk_norm=QK_NORM_HEAD,
        attn_scale=scalar ** -0.5,
        final_softcap=cfg.final_logit_softcapping,
        layer_windows=windows,
        embed_scale=math.sqrt(cfg.hidden_size),
        mlp_act=GELU_TANH,
        layer_ropes=tuple(Rope(cfg.rope_theta, cfg.rope_scaling) if w is None else local for w in windows),
    )


class Gemma3ForCausalLM(CausalLM):
    spec_of = staticmethod(spec)


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def gguf_config(gguf: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's metadata: the window (absent or 0: every layer global), five sliding layers to
    each global one (llama.cpp's fixed pattern), rope.freq_base the global layers' base with
    their linear scaling (read with every family's), rope.freq_base_swa the sliding layers' where
    the converter wrote it (from transformers >= 5 configs; else 10000, every Gemma 3's), the
    final soft-cap where set. The q/k norms stay Gemma 3's parts, not Qwen3's qk_norm flag."""
    layers = fields["num_hidden_layers"]
    window = int(gguf.arch_field("attention.sliding_window", 0) or 0)
    layer_types = swa_layer_types(gguf, layers, period=6) if window else ("full_attention",) * layers
    return dict(
        hidden_act="gelu_pytorch_tanh",
        layer_types=layer_types,
        sliding_window=window or None,
        query_pre_attn_scalar=gguf_query_pre_attn_scalar(fields, largest_model_layers=62),
        final_logit_softcapping=_optional_float(gguf.arch_field("final_logit_softcapping")),
        rope_local_theta=float(gguf.arch_field("rope.freq_base_swa", 10_000.0)),
        qk_norm=False,
    )


GGUF = GGUFLayout("gemma3", layer_tensors=GEMMA_GGUF_TENSORS, norm_offset=1.0, config_fields=gguf_config)
