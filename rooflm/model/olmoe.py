"""OLMoE (OlmoeForCausalLM; OLMoE-1B-7B): Llama's pre-norm layer with RMSNorm over the whole q and k
projections before they are split into heads (HF's OlmoeAttention: q_norm over hidden_size, k_norm
over the KV width, as OLMo 2's) and a sparse MoE block for every MLP, norm_topk_prob per config.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata, moe_gguf_fields
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


def gguf_config(gguf_file: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    clamp = gguf_file.arch_field("attention.clamp_kqv")
    if clamp is not None:
        raise ValueError(f"attention.clamp_kqv={clamp}: rooflm does not clamp q, k and v")
    # OLMoE's router weights are not renormalised (llama.cpp's graph, HF's default); its q/k norms
    # are the family's own (spec), whatever the reader inferred from attn_q_norm
    return dict(qk_norm=False, **moe_gguf_fields(gguf_file, fields["num_hidden_layers"], norm_topk_prob=False))


# llama.cpp's "olmoe": NEOX rotary (q/k unpermuted), attn_q_norm / attn_k_norm over the whole
# projections, the experts stacked as in Qwen3-MoE's files.
GGUF = GGUFLayout("olmoe", config_fields=gguf_config, moe=True)


class OlmoeForCausalLM(CausalLM):
    spec_of = staticmethod(spec)
