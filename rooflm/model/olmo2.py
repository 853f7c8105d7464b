"""OLMo 2 (Olmo2ForCausalLM): the Llama decoder with the norms moved after each sublayer
(h + norm(attn(h)), h + norm(mlp(h)): no pre-norms) and RMSNorm over the whole q and k
projections, before they are split into heads. config.json holds nothing beyond the Llama
fields; the checkpoint names are Llama's, the post-MLP norm's aside.
"""

from __future__ import annotations

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
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
