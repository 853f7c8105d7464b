"""An HF model directory without weights: a preset's config.json plus a real tokenizer.

`--load-format dummy` with such a directory builds the preset's shape with
random weights and serves it with the directory's tokenizer, so serving
benchmarks of an 8B shape stream real text (TTFT, TPOT and ITL per token)
without downloading 16 GB of weights. The directory holds tokenizer files and
config.json only (a few MB), small enough to travel to a GPU machine.

The config's vocab_size is the tokenizer's vocabulary size, not the preset's:
every id the random model samples then decodes to text. The preset's own BOS
and EOS ids would lie outside that vocabulary, so the tokenizer's are used.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Optional

from rooflm.config import ModelConfig
from rooflm.model import presets
from rooflm.model.errors import ModelLoadError

README_FILE = "README.md"

# transformers' model_type per architecture, for a config.json AutoConfig can read too.
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The config.json of a ModelConfig, in the dialect rooflm's loader and transformers read
    (transformers < 5: top-level rope_theta and rope_scaling)."""
    cfg: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": _MODEL_TYPES.get(config.architecture, "llama"),
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
        cfg["rope_scaling"] = {
            "rope_type": config.rope_scaling.rope_type, "factor": config.rope_scaling.factor,
            "low_freq_factor": config.rope_scaling.low_freq_factor,
            "high_freq_factor": config.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings}
    # Qwen2 has q/k/v bias by architecture and Qwen3 its q/k norm: neither is a config field.
    if config.architecture == "MistralForCausalLM":
        cfg["sliding_window"] = config.sliding_window
    elif config.sliding_window is not None:
        cfg.update(use_sliding_window=True, sliding_window=config.sliding_window,
                   max_window_layers=0)
    if config.bos_token_id is not None:
        cfg["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        cfg["eos_token_id"] = (config.eos_token_ids[0] if len(config.eos_token_ids) == 1
                               else list(config.eos_token_ids))
    return cfg


def _load_source_tokenizer(tokenizer_from: str):
    """'default' (the shipped SmolLM2 GGUF), a .gguf file, or an HF tokenizer directory."""
    from rooflm.model.loader import default_model_path
    from rooflm.tokenizer.tokenizer import Tokenizer

    if tokenizer_from == "default":
        return Tokenizer.load(default_model_path(), "gguf")
    if tokenizer_from.endswith(".gguf"):
        return Tokenizer.load(tokenizer_from, "gguf")
    return Tokenizer.load(tokenizer_from, "safetensors")


def _embed_chat_template(out_dir: str, chat_template: Optional[str]) -> None:
    """Recent transformers save the chat template as chat_template.jinja, which releases before
    4.50 do not read; a copy in tokenizer_config.json serves both (the .jinja wins when read)."""
    if not chat_template:
        return
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    if tokenizer_config.get("chat_template") == chat_template:
        return
    tokenizer_config["chat_template"] = chat_template
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def make_dummy_model_dir(preset: str, out_dir: str, tokenizer_from: str = "default",
                         max_position_embeddings: Optional[int] = None) -> ModelConfig:
    """Write config.json (the preset's shape, the tokenizer's vocabulary), the tokenizer files
    and a README line into out_dir; return the ModelConfig the directory describes."""
    try:
        shape = presets.get_preset(preset)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    tokenizer = _load_source_tokenizer(tokenizer_from)
    eos = tokenizer.eos_token_id
    config = replace(shape, vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                     eos_token_ids=() if eos is None else (eos,))
    if max_position_embeddings is not None:
        config = replace(config, max_position_embeddings=max_position_embeddings)

    os.makedirs(out_dir, exist_ok=True)
    tokenizer.hf.save_pretrained(out_dir)
    _embed_chat_template(out_dir, tokenizer.chat_template)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(config), f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, README_FILE), "w", encoding="utf-8") as f:
        f.write(
            f"# {os.path.basename(os.path.normpath(out_dir))}: the {preset} shape, no weights\n\n"
            f"Serve with `--load-format dummy` (random weights). config.json is the {preset} "
            f"preset with vocab_size set to the tokenizer's vocabulary ({config.vocab_size} "
            f"instead of {shape.vocab_size}) so that every sampled id decodes to text, and the "
            f"tokenizer's BOS/EOS ids. The tokenizer is {tokenizer_from!r}. Made by "
            f"benchmarks/make_dummy_model_dir.py.\n")
    return config
