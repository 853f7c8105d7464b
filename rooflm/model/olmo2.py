"""OLMo 2 (Olmo2ForCausalLM): the Llama decoder with the norms moved after each sublayer
(h + norm(attn(h)), h + norm(mlp(h)): no pre-norms) and RMSNorm over the whole q and k
projections, before they are split into heads. config.json holds nothing beyond the Llama
fields; the checkpoint names are Llama's, the post-MLP norm's aside.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata, swa_layer_types
from rooflm.model.spec import QK_NORM_PROJ, ModelSpec, layer_windows

ARCHITECTURE = "Olmo2ForCausalLM"
MODEL_TYPE = "olmo2"


def spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(
        pre_attn_norm=None,
        post_attn_norm="post_attention_layernorm",
        pre_mlp_norm=None,
        post_mlp_norm="post_feedforward_layernorm",
        qk_norm=QK_NORM_PROJ,
        layer_windows=layer_windows(cfg),
    )


class Olmo2ForCausalLM(CausalLM):
    spec_of = staticmethod(spec)


def gguf_config(gguf: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """Nothing beyond the Llama metadata, but a window where the converter wrote one (it writes
    OLMo 3 as olmo2: sliding layers but every 4th); the q/k norms are OLMo 2's parts, not Qwen3's
    qk_norm flag."""
    window = int(gguf.arch_field("attention.sliding_window", 0) or 0)
    if not window:
        return dict(qk_norm=False)
    return dict(qk_norm=False, sliding_window=window,
                layer_types=swa_layer_types(gguf, fields["num_hidden_layers"], period=4))


# GGUF: the post-norms under llama.cpp's names, q/k unpermuted (NEOX rotary).
GGUF = GGUFLayout("olmo2", layer_tensors={"post_attention_norm": "post_attention_layernorm",
                                          "post_ffw_norm": "post_feedforward_layernorm"},
                  config_fields=gguf_config)
