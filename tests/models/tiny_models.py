"""Tiny random HF checkpoints of every supported family, for loader and parity tests.

    path, hf_model = make_tiny_model(tmp_path, "qwen2", attention="mqa")

builds a 2-layer, hidden-64 model with transformers, saves it with
save_pretrained(safe_serialization=True) into a fresh directory under
`root`, and returns the directory and the HF model (eval mode, float32
unless `dtype` says otherwise). A build takes tens of milliseconds.

HF initialises RMSNorm weights to ones and biases to zeros; a loader that
swapped two norms or dropped a bias would still match. So norms and biases
are re-drawn around their usual values, making every tensor distinguishable.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2")

# attention option -> number of KV heads, with 4 query heads
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}

TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# Llama-3.1's scaling with the original context shrunk to the tiny model's scale,
# so that all three regions (unscaled, smoothed, fully scaled) have frequencies in them.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_hf_config(family: str, *, tied: bool = False, attention: str = "gqa",
                   rope_scaling: bool = False, **overrides: Any):
    """The transformers config of a tiny model; overrides replace any field."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    if attention not in KV_HEADS:
        raise ValueError(f"unknown attention {attention!r}; one of {tuple(KV_HEADS)}")
    if rope_scaling and family != "llama":
        raise ValueError("llama3 rope scaling is a Llama variant")

    fields: dict[str, Any] = dict(TINY_SHAPE)
    fields["num_key_value_heads"] = KV_HEADS[attention]
    fields["tie_word_embeddings"] = tied
    fields["bos_token_id"] = 1
    fields["eos_token_id"] = 2
    if family == "llama":
        config_class = transformers.LlamaConfig
        fields["rope_theta"] = 10000.0
        if rope_scaling:
            fields["rope_scaling"] = dict(LLAMA3_ROPE_SCALING)
    elif family == "mistral":
        config_class = transformers.MistralConfig
        # MistralConfig defaults to a 4096-token window (v0.1); v0.2+ has none.
        fields["sliding_window"] = None
    elif family == "qwen2":
        config_class = transformers.Qwen2Config
    elif family == "olmo2":
        config_class = transformers.Olmo2Config
    elif family == "gemma2":
        config_class = transformers.Gemma2Config
        # Off the defaults (head_dim 256, scalar 256, window 4096, caps 50/30) so each option
        # acts at this size: a window shorter than the prompts, a scale that is not 1/sqrt(head_dim),
        # caps the tiny model's scores and logits reach.
        fields.update(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                      attn_logit_softcapping=4.0, final_logit_softcapping=8.0, num_hidden_layers=4)
    else:
        config_class = transformers.Qwen3Config
        # Qwen3Config defaults head_dim to 128, independent of hidden size; keep
        # it off hidden/heads so the loader must read it from config.json.
        fields["head_dim"] = 32
    fields.update(overrides)
    return config_class(**fields)


def _randomize_norms_and_biases(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))


def make_tiny_model(root: str | os.PathLike, family: str, *, tied: bool = False,
                    attention: str = "gqa", rope_scaling: bool = False,
                    dtype: torch.dtype = torch.float32, seed: int = 0,
                    name: Optional[str] = None, **overrides: Any):
    """Build, save and return (checkpoint directory, HF model) for one tiny variant.

    family: llama | mistral | qwen2 | qwen3 | olmo2 | gemma2
    tied: tie_word_embeddings (no lm_head.weight in the checkpoint)
    attention: mha (4 KV heads) | gqa (2) | mqa (1), with 4 query heads
    rope_scaling: Llama only, Llama-3.1 "llama3" scaling
    dtype: the dtype the weights are saved in (and the returned model has)
    name: directory name under root; by default derived from the options
    overrides: any config field, e.g. num_hidden_layers=3
    """
    import transformers

    config = tiny_hf_config(family, tied=tied, attention=attention,
                            rope_scaling=rope_scaling, **overrides)
    torch.manual_seed(seed)
    # Gemma 2's soft-capped scores need HF's eager attention (its SDPA path has no cap).
    extra = {"attn_implementation": "eager"} if family == "gemma2" else {}
    model = transformers.AutoModelForCausalLM.from_config(config, **extra)
    generator = torch.Generator().manual_seed(seed + 1)
    _randomize_norms_and_biases(model, generator)
    model = model.to(dtype).eval()

    if name is None:
        parts = [family, attention, "tied" if tied else "untied"]
        if rope_scaling:
            parts.append("llama3rope")
        if dtype != torch.float32:
            parts.append(str(dtype).replace("torch.", ""))
        parts.append(f"seed{seed}")
        name = "-".join(parts)
    path = os.path.join(os.fspath(root), name)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def make_tiny_model_with_tokenizer(root) -> str:
    """A tiny Llama checkpoint with a word-level tokenizer over its vocabulary (words w3..w255),
    for tests that send text through a server or the Hub path."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    path, _ = make_tiny_model(root, "llama", initializer_range=0.3)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path
