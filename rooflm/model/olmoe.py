"""OLMoE (OlmoeForCausalLM; OLMoE-1B-7B): Llama's pre-norm layer with RMSNorm over the whole q and k
projections before they are split into heads (HF's OlmoeAttention: q_norm over hidden_size, k_norm
over the KV width, as OLMo 2's) and a sparse MoE block for every MLP, norm_topk_prob per config.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.moe_config import moe_config_fields
from rooflm.model.spec import QK_NORM_PROJ, ModelSpec, layer_windows, moe_parts

ARCHITECTURE = "OlmoeForCausalLM"
MODEL_TYPE = "olmoe"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={raw['clip_qkv']}: rooflm does not clamp q, k and v")
    return moe_config_fields(raw)


def spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(qk_norm=QK_NORM_PROJ, layer_windows=layer_windows(cfg), **moe_parts(cfg))


class OlmoeForCausalLM(CausalLM):
    spec_of = staticmethod(spec)
