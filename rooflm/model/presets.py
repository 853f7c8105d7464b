"""Named shapes of real models, for dummy-weight runs and the perf calculators.

Values are copied from each model's published config.json. With
`load_format="dummy"` the engine builds the exact shape with random weights,
the way benchmarks of real-size models run without downloading them.
"""

from __future__ import annotations

from rooflm.config import ModelConfig, RopeScaling


def _gemma3_layer_types(layers: int) -> tuple[str, ...]:
    """Gemma 3's pattern: every sixth layer global, the others sliding."""
    return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))


# Phi-4-mini-instruct's config.json rope_scaling.long_factor (its short_factor is all ones).
_PHI4_MINI_LONG_FACTOR = (
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
    5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
    11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
    25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
    32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77)

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
    # Gemma-3-12B (text): 5 sliding (1024) to 1 global layer, q/k norms, local and global RoPE
    # bases, linear 8x scaling on the global ones (model/gemma3.py).
    "gemma-3-12b": ModelConfig(
        architecture="Gemma3ForCausalLM", vocab_size=262208, hidden_size=3840,
        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=RopeScaling("linear", 8.0), rope_local_theta=10000.0,
        max_position_embeddings=131072, tie_word_embeddings=True, sliding_window=1024,
        layer_types=_gemma3_layer_types(48), hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=256.0, bos_token_id=2, eos_token_ids=(1, 106)),
    "gemma-3-1b": ModelConfig(
        architecture="Gemma3ForCausalLM", vocab_size=262144, hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        sliding_window=512, layer_types=_gemma3_layer_types(26), hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=256.0, bos_token_id=2, eos_token_ids=(1, 106)),
    # Phi-4-mini-instruct: RoPE on 96 of 128 dims, LongRoPE (model/phi3.py).
    "phi-4-mini": ModelConfig(
        architecture="Phi3ForCausalLM", vocab_size=200064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=RopeScaling("longrope", factor=32.0, original_max_position_embeddings=4096,
                                 short_factor=(1.0,) * 48, long_factor=_PHI4_MINI_LONG_FACTOR),
        partial_rotary_factor=0.75, max_position_embeddings=131072, tie_word_embeddings=True,
        sliding_window=262144, bos_token_id=199999, eos_token_ids=(200020, 199999)),
    # Granite-3.1-8B: muP multipliers on the embedding, residual branches, scores and logits
    # (model/granite.py).
    "granite-3-8b": ModelConfig(
        architecture="GraniteForCausalLM", vocab_size=49155, hidden_size=4096,
        intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000000.0,
        max_position_embeddings=131072, tie_word_embeddings=True, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
        bos_token_id=0, eos_token_ids=(0,)),
    # SmolLM3-3B: no RoPE on every 4th layer (model/smollm3.py).
    "smollm3-3b": ModelConfig(
        architecture="SmolLM3ForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=5000000.0,
        max_position_embeddings=65536, tie_word_embeddings=True,
        no_rope_layers=(1, 1, 1, 0) * 9, bos_token_id=128000, eos_token_ids=(128012,)),
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
    # gpt-oss-20b (model/gpt_oss.py): sinks, 128-token windows on even layers, YaRN, 32 experts
    # top-4 with biases and clamped SwiGLU. 20.91B parameters, 4.19B active with the embedding
    # (OpenAI's 3.61B leaves the embedding out).
    "gpt-oss-20b": ModelConfig(
        architecture="GptOssForCausalLM", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling=RopeScaling("yarn", factor=32.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, truncate=False),
        max_position_embeddings=131072, sliding_window=128,
        layer_types=("sliding_attention", "full_attention") * 12, attention_bias=True,
        o_proj_bias=True, attention_sinks=True, moe_bias=True, num_experts=32,
        num_experts_per_tok=4, bos_token_id=199998, eos_token_ids=(200002, 199999, 200012)),
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
