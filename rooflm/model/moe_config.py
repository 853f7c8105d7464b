"""config.json -> the ModelConfig fields of a mixture-of-experts family (HF's names and defaults),
shared by the MoE family files (qwen3_moe.py, qwen2_moe.py, mixtral.py, olmoe.py). The spec's
MoE parts follow from these fields (model/spec.py moe_parts).
"""

from __future__ import annotations

from typing import Any, Optional


def moe_config_fields(raw: dict[str, Any], norm_topk_prob: Optional[bool] = None) -> dict[str, Any]:
    """The MoE fields; norm_topk_prob: the family's fixed choice (Mixtral: True), None: config.json's."""
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not experts:
        raise ValueError("no num_experts / num_local_experts in config.json")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: rooflm's experts compute SiLU-gated MLPs")
    if norm_topk_prob is None:
        norm_topk_prob = bool(raw.get("norm_topk_prob", False))
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    )


def no_qwen_sliding_window(raw: dict[str, Any], family: str) -> None:
    """Qwen-MoE configs carry sliding_window but use it only with use_sliding_window."""
    if raw.get("use_sliding_window", False):
        raise ValueError(f"{family} with use_sliding_window=true: rooflm runs it with full attention only")
