"""A real-shape GGUF of a parts family with random weights, laid out as llama.cpp's converter (and
llama-quantize) writes one: the decoder layers' matrices in --fmt (Q4_0 by default), the token
embedding in --embedding-fmt (Q8_0 by default, llama-quantize's --token-embedding-type: a tied head
then reads 8.5 bits a weight in both engines, not an F16 or fp32 copy), norms F32 (Gemma's stored as
1 + w), q/k permuted where the converter permutes. For speed
comparisons on the CPU (benchmarks/cpu_vs_llamacpp.py --model FILE): random weights run at the
speed real ones do.

    python benchmarks/family_gguf.py --preset gemma-3-1b --out /tmp/gemma-3-1b-q4_0.gguf
    python benchmarks/family_gguf.py --preset phi-4-mini --out /tmp/phi-4-mini-q4_0.gguf

The layout rules (metadata keys, names, permutation, +1) are the ones tests/models/test_gguf_families.py
writes and checks against transformers' GGUF reader; this script reuses them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from rooflm.model.hf_config import hf_config_dict  # noqa: E402
from rooflm.model.presets import PRESETS  # noqa: E402
from tests.models.test_gguf_families import (GGUF_ARCH, NORM_PLUS_ONE, PERMUTED, _add, _metadata,  # noqa: E402
                                             llama_cpp_permute)

FAMILY_OF = {"Gemma3ForCausalLM": "gemma3", "Gemma2ForCausalLM": "gemma2", "Phi3ForCausalLM": "phi3",
             "GraniteForCausalLM": "granite", "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, choices=sorted(n for n, c in PRESETS.items() if c.architecture in FAMILY_OF))
    p.add_argument("--fmt", default="Q4_0", choices=["Q4_0", "Q8_0", "F16"])
    p.add_argument("--embedding-fmt", default="Q8_0", choices=["Q8_0", "F16"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    config = PRESETS[args.preset]
    family = FAMILY_OF[config.architecture]
    fields = hf_config_dict(config)
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if isinstance(cfg.eos_token_id, (list, tuple)):  # GGUF holds one EOS id (the first, as the converter writes)
        cfg.eos_token_id = cfg.eos_token_id[0]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    arch = GGUF_ARCH[family]
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        cfg.num_hidden_layers)
    w = gguf.GGUFWriter(args.out, arch)
    _metadata(w, family, cfg)
    rng = np.random.default_rng(args.seed)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and (cfg.tie_word_embeddings or family in NORM_PLUS_ONE):
            continue
        module, suffix = hf_name.rsplit(".", 1)
        if hf_name.endswith("norm.weight"):
            array = np.ones(tuple(tensor.shape), dtype=np.float32)  # the scale 1: Gemma's w = 0
        else:
            array = rng.standard_normal(tuple(tensor.shape), dtype=np.float32) * 0.02
        if family in PERMUTED and module.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        fmt = args.fmt if module.startswith("model.layers.") else args.embedding_fmt
        _add(w, f"{name_map.get_name(module)}.{suffix}", array, fmt)
        print(f"{hf_name} {tuple(tensor.shape)} {fmt if array.ndim > 1 else 'F32'}", file=sys.stderr, flush=True)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if family == "phi3" and rope.get("long_factor"):
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
