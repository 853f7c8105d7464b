"""A ModelConfig written as an HF config.json dict, in the dialect rooflm's loader and
transformers' AutoConfig both read: dummy model directories (rooflm/tokenizer/dummy_model_dir.py),
training checkpoints and `rooflm quantize`'s output directories carry it.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig, RopeScaling

from rooflm.model.registry import FAMILIES


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The config.json of a ModelConfig, in the dialect rooflm's loader and transformers read
    (transformers < 5: top-level rope_theta and rope_scaling)."""
    cfg: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": FAMILIES[config.architecture].model_type if config.architecture in FAMILIES else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": "bfloat16",
    }
    if config.rope_scaling is not None:
        cfg["rope_scaling"] = _rope_scaling_dict(config.rope_scaling)
        if config.rope_scaling.rope_type == "longrope":  # Phi-3 reads it top-level, over rope_scaling's
            cfg["original_max_position_embeddings"] = config.rope_scaling.original_max_position_embeddings
    # Qwen2 has q/k/v bias by architecture and Qwen3 its q/k norm: neither is a config field.
    if config.architecture == "MistralForCausalLM":
        cfg["sliding_window"] = config.sliding_window
    elif config.sliding_window is not None:
        cfg.update(use_sliding_window=True, sliding_window=config.sliding_window,
                   max_window_layers=0)
    if config.layer_types:  # a family whose layers differ (Gemma 2) reads its own fields back
        cfg.update(layer_types=list(config.layer_types), sliding_window=config.sliding_window,
                   use_sliding_window="sliding_attention" in config.layer_types,
                   hidden_activation=config.hidden_act, query_pre_attn_scalar=_integral(config.query_pre_attn_scalar),
                   attn_logit_softcapping=config.attn_logit_softcapping,
                   final_logit_softcapping=config.final_logit_softcapping)
    # The other families' fields, where they differ from the defaults that leave a Llama unchanged.
    if config.partial_rotary_factor != 1.0:
        cfg["partial_rotary_factor"] = config.partial_rotary_factor
    if config.rope_local_theta is not None:
        cfg["rope_local_base_freq"] = config.rope_local_theta
    if config.no_rope_layers:
        cfg["no_rope_layers"] = list(config.no_rope_layers)
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if getattr(config, name) != 1.0:
            cfg[name] = getattr(config, name)
    if config.attention_multiplier is not None:
        cfg["attention_multiplier"] = config.attention_multiplier
    if config.num_experts:  # both spellings of the expert count: each family's reader takes its own
        cfg.update(num_experts=config.num_experts, num_local_experts=config.num_experts,
                   num_experts_per_tok=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                   decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=list(config.mlp_only_layers))
        if config.moe_intermediate_size:
            cfg["moe_intermediate_size"] = config.moe_intermediate_size
        if config.shared_expert_intermediate_size:
            cfg["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if config.o_proj_bias:  # gpt-oss: attention_bias covers o_proj too; its experts' SwiGLU clamps
        cfg.update(attention_bias=config.attention_bias, swiglu_alpha=config.swiglu_alpha,
                   swiglu_limit=config.swiglu_limit)
    if config.bos_token_id is not None:
        cfg["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        cfg["eos_token_id"] = (config.eos_token_ids[0] if len(config.eos_token_ids) == 1
                               else list(config.eos_token_ids))
    return cfg


def _rope_scaling_dict(scaling: RopeScaling) -> dict[str, Any]:
    """HF's rope_scaling dict of a RopeScaling, the keys of its type only."""
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.rope_type == "longrope":
        out = {"rope_type": "longrope", "factor": scaling.factor, "short_factor": list(scaling.short_factor),
               "long_factor": list(scaling.long_factor),
               "original_max_position_embeddings": scaling.original_max_position_embeddings}
        if scaling.attention_factor is not None:
            out["attention_factor"] = scaling.attention_factor
        return out
    if scaling.rope_type == "yarn":
        out = {"rope_type": "yarn", "factor": scaling.factor, "beta_fast": scaling.beta_fast,
               "beta_slow": scaling.beta_slow, "truncate": scaling.truncate,
               "original_max_position_embeddings": scaling.original_max_position_embeddings}
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(scaling, key) is not None:
                out[key] = getattr(scaling, key)
        return out
    return {"rope_type": scaling.rope_type, "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def _integral(value):
    """A whole float as an int: transformers' strict configs type some of these fields int (Gemma 3)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
