"""Mixtral (MixtralForCausalLM; Mixtral-8x7B, 8x22B): Mistral's layer with every MLP a sparse MoE
block, its top-k routing weights always renormalised. The checkpoint names the block
block_sparse_moe and an expert's gate, up and down w1, w3, w2.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata, moe_gguf_fields
from rooflm.model.moe_config import moe_config_fields
from rooflm.model.spec import ModelSpec, layer_windows, moe_parts

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window")
    return dict(sliding_window=None if window is None else int(window),
                **moe_config_fields(raw, norm_topk_prob=True))


def spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(layer_windows=layer_windows(cfg), moe_prefix="block_sparse_moe",
                     expert_projs=("w1", "w3", "w2"), **moe_parts(cfg))


def gguf_config(gguf_file: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    window = gguf_file.arch_field("attention.sliding_window")
    return dict(sliding_window=int(window) if window else None,
                **moe_gguf_fields(gguf_file, fields["num_hidden_layers"], norm_topk_prob=True))


# llama.cpp converts Mixtral as a Llama (q/k permuted) with llama.expert_count and the experts
# stacked as blk.N.ffn_{gate,up,down}_exps (w1, w3, w2).
GGUF = GGUFLayout("llama", rotary_permuted=True, config_fields=gguf_config, moe=True)


class MixtralForCausalLM(CausalLM):
    spec_of = staticmethod(spec)
