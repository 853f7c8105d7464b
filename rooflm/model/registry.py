"""Architecture name (config.json "architectures"[0] or GGUF general.architecture) -> model class."""

from __future__ import annotations

# HF architecture names we run, and the GGUF architecture strings that map to them.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def get_model_class(architecture: str):
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; rooflm runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    from rooflm.model.llama import LlamaForCausalLM  # one definition serves every family
    return LlamaForCausalLM
