"""An HF model directory without weights: a preset's config.json plus a real tokenizer.

`--load-format dummy` with such a directory builds the preset's shape with random weights and
serves it with the directory's tokenizer, so serving benchmarks of an 8B shape stream real text
without downloading its weights (benchmarks/make_dummy_model_dir.py makes one). It lives with the
tokenizer because a tokenizer is what it adds to the model's config (rooflm/model/hf_config.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Optional

from rooflm.config import ModelConfig
from rooflm.errors import ModelLoadError
from rooflm.model import presets
from rooflm.model.hf_config import hf_config_dict
from rooflm.model.loader import default_model_path
from rooflm.tokenizer.tokenizer import Tokenizer

README_FILE = "README.md"


def _load_source_tokenizer(tokenizer_from: str):
    """'default' (the shipped SmolLM2 GGUF), a .gguf file, or an HF tokenizer directory."""
    if tokenizer_from == "default":
        return Tokenizer.load(default_model_path(), "gguf")
    if tokenizer_from.endswith(".gguf"):
        return Tokenizer.load(tokenizer_from, "gguf")
    return Tokenizer.load(tokenizer_from, "safetensors")


def embed_chat_template(out_dir: str, chat_template: Optional[str]) -> None:
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
    embed_chat_template(out_dir, tokenizer.chat_template)
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
