"""Named shapes of real models, for dummy-weight runs and the perf calculators.

Values are copied from each model's published config.json. With
`load_format="dummy"` the engine builds the exact shape with random weights,
the way benchmarks of real-size models run without downloading them.
"""

from __future__ import annotations

from rooflm.config import ModelConfig, RopeScaling

PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=4096,
        intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    # Llama-3.2-1B: the training benchmark's 1B-class shape (benchmarks/train.sh) and the
    # speculative-decoding draft beside the 8B (benchmarks/spec_decode.sh).
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "mistral-7b": ModelConfig(
        architecture="MistralForCausalLM", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=32768, sliding_window=4096, bos_token_id=1, eos_token_ids=(2,)),
    "qwen2.5-7b": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, attention_bias=True, bos_token_id=151643,
        eos_token_ids=(151645, 151643)),
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643)),
    # OLMo-2-1124-7B: post-norms and q/k norms over the projections (model/olmo2.py).
    "olmo-2-7b": ModelConfig(
        architecture="Olmo2ForCausalLM", vocab_size=100352, hidden_size=4096,
        intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, rope_theta=500000.0,
        max_position_embeddings=4096, eos_token_ids=(100257,)),
    # Gemma-2-9B: soft-capping, alternating 4096-token windows, tied head (model/gemma2.py).
    "gemma-2-9b": ModelConfig(
        architecture="Gemma2ForCausalLM", vocab_size=256000, hidden_size=3584,
        intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, sliding_window=4096,
        layer_types=("sliding_attention", "full_attention") * 21, hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=256.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        bos_token_id=2, eos_token_ids=(1, 107)),
    # Mixtures of experts (model/qwen3_moe.py, mixtral.py, olmoe.py): total vs active parameters
    # in ModelConfig.num_params / num_active_params.
    "qwen3-30b-a3b": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, bos_token_id=151643,
        eos_token_ids=(151645, 151643), num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True),
    "mixtral-8x7b": ModelConfig(
        architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,), num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True),
    "olmoe-1b-7b": ModelConfig(
        architecture="OlmoeForCausalLM", vocab_size=50304, hidden_size=2048,
        intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, eos_token_ids=(50279,), num_experts=64,
        num_experts_per_tok=8),
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,)),
}


def get_preset(name: str) -> ModelConfig:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
