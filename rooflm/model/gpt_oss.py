"""gpt-oss (GptOssForCausalLM; gpt-oss-20b, gpt-oss-120b): pre-norm layers whose attention has
biases on q, k, v and o, a learned sink logit per query head in each softmax's denominator, and
sliding-window (128 tokens) and full layers alternating; YaRN RoPE; every MLP a sparse MoE block
routed by a softmax over the top-k logits (router bias), each expert a clamped SwiGLU
((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit) with biases.

Checkpoint names: model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks,
mlp.router.{weight,bias}, mlp.experts.gate_up_proj [E, H, 2I] (x @ W, gate and up columns
alternating) with gate_up_proj_bias [E, 2I], mlp.experts.down_proj [E, I, H] with down_proj_bias;
OpenAI's release stores the experts in MXFP4 (gate_up_proj_blocks / _scales), dequantized on load
(model/mxfp4.py).
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig, RopeScaling
from rooflm.layers.moe import MoeConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.spec import MOE, ModelSpec, layer_windows

ARCHITECTURE = "GptOssForCausalLM"
MODEL_TYPE = "gpt_oss"

# HF's defaults (GptOssConfig) for a config.json that leaves them out.
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_YARN = RopeScaling("yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                           beta_slow=1.0, truncate=False)


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the ModelConfig fields gpt-oss adds (HF's defaults where absent)."""
    layers = int(raw["num_hidden_layers"])
    experts = raw.get("num_local_experts") or raw.get("num_experts")
    if not experts:
        raise ValueError("no num_local_experts in config.json")
    # HF's default pattern: even layers slide, odd ones attend to everything.
    layer_types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(layers)]
    window = raw.get("sliding_window", 128)
    bias = bool(raw.get("attention_bias", True))
    fields = dict(
        layer_types=tuple(layer_types),
        sliding_window=None if window is None else int(window),
        attention_bias=bias,
        o_proj_bias=bias,
        attention_sinks=True,
        moe_bias=True,
        num_experts=int(experts),
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        fields.update(rope_theta=float(raw.get("rope_theta", DEFAULT_ROPE_THETA)), rope_scaling=DEFAULT_YARN)
    return fields


def moe_config(cfg: ModelConfig) -> MoeConfig:
    """The experts of every layer: softmax over the top-k logits of x W^T + b, clamped SwiGLU with
    biases, the checkpoint's interleaved gate/up columns."""
    return MoeConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.expert_intermediate_size, scoring="softmax_topk", router_bias=True,
                     expert_bias=True, activation="swigluoai", swiglu_alpha=cfg.swiglu_alpha,
                     swiglu_limit=cfg.swiglu_limit, gate_up_interleaved=True)


def spec(cfg: ModelConfig) -> ModelSpec:
    if not cfg.num_experts:
        raise ValueError("gpt-oss needs num_local_experts")
    return ModelSpec(layer_windows=layer_windows(cfg), attn_sinks=cfg.attention_sinks, o_proj_bias=cfg.o_proj_bias,
                     layer_mlps=(MOE,) * cfg.num_hidden_layers, moe=moe_config(cfg))


class GptOssForCausalLM(CausalLM):
    spec_of = staticmethod(spec)
