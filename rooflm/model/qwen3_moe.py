"""Qwen3-MoE (Qwen3MoeForCausalLM; Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's layer (RMSNorm over each
q and k head) with a sparse MoE block for the MLP: top-k of a softmax router, the k weights
renormalised when norm_topk_prob says so. Layers listed in mlp_only_layers, or off the
decoder_sparse_step, keep a dense MLP of intermediate_size, as in HF. Checkpoint names:
model.layers.{i}.mlp.gate.weight, mlp.experts.{e}.gate_proj|up_proj|down_proj.weight.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata, moe_gguf_fields
from rooflm.model.moe_config import moe_config_fields, no_qwen_sliding_window
from rooflm.model.spec import QK_NORM_HEAD, ModelSpec, layer_windows, moe_parts

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    no_qwen_sliding_window(raw, "Qwen3-MoE")
    return dict(qk_norm=True, **moe_config_fields(raw))


def spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(qk_norm=QK_NORM_HEAD, layer_windows=layer_windows(cfg), **moe_parts(cfg))


def gguf_config(gguf_file: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    return dict(qk_norm=True, **moe_gguf_fields(gguf_file, fields["num_hidden_layers"], norm_topk_prob=True))


# llama.cpp's "qwen3moe": Qwen3's tensors (NEOX rotary, unpermuted) and the stacked experts
# blk.N.ffn_{gate,up,down}_exps [E, rows, cols] beside the router blk.N.ffn_gate_inp (gguf_loader).
GGUF = GGUFLayout("qwen3moe", config_fields=gguf_config, moe=True)


class Qwen3MoeForCausalLM(CausalLM):
    spec_of = staticmethod(spec)
