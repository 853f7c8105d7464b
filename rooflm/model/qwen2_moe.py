"""Qwen2-MoE (Qwen2MoeForCausalLM; Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's layer (q/k/v bias)
with a sparse MoE block beside a shared expert every token goes through, scaled by
sigmoid(x . shared_expert_gate). Sparse and dense layers follow mlp_only_layers and
decoder_sparse_step, as in HF.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata, moe_gguf_fields
from rooflm.model.moe_config import moe_config_fields, no_qwen_sliding_window
from rooflm.model.spec import ModelSpec, layer_windows, moe_parts

ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    no_qwen_sliding_window(raw, "Qwen2-MoE")
    # q/k/v bias by architecture (transformers 5 writes it as qkv_bias); never an o_proj bias.
    return dict(attention_bias=bool(raw.get("qkv_bias", True)), **moe_config_fields(raw))


def spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(layer_windows=layer_windows(cfg), **moe_parts(cfg))


def gguf_config(gguf_file: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's graph does not renormalise Qwen2-MoE's top-k weights (HF's default either)
    return moe_gguf_fields(gguf_file, fields["num_hidden_layers"], norm_topk_prob=False)


# llama.cpp's "qwen2moe": Qwen2's tensors (q/k/v biases, NEOX rotary), the stacked experts, and the
# shared expert blk.N.ffn_{gate,up,down}_shexp with its gate blk.N.ffn_gate_inp_shexp (gguf_loader).
GGUF = GGUFLayout("qwen2moe", config_fields=gguf_config, moe=True)


class Qwen2MoeForCausalLM(CausalLM):
    spec_of = staticmethod(spec)
