"""Make an HF model directory with no weights, for serving benchmarks on dummy weights.

Usage: python benchmarks/make_dummy_model_dir.py --preset llama-3-8b --tokenizer-from default \
           --out /tmp/llama-3-8b-dummy

Writes the preset's config.json, with vocab_size set to the tokenizer's vocabulary so every
sampled id decodes, and the tokenizer files (tokenizer.json, tokenizer_config.json with its chat
template, special tokens) converted from the shipped SmolLM2 GGUF ('default'), another .gguf,
or an HF tokenizer directory. A few MB: small enough to carry to a GPU machine, where
`rooflm serve --model DIR --load-format dummy` serves the shape with random weights and real text.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm.tokenizer.dummy_model_dir import make_dummy_model_dir  # noqa: E402
from rooflm.model.presets import PRESETS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the model shape")
    p.add_argument("--tokenizer-from", default="default",
                   help="'default' (the shipped SmolLM2 GGUF), a .gguf file or an HF directory")
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="override the preset's context length")
    p.add_argument("--out", required=True, help="the directory to write")
    args = p.parse_args(argv)
    config = make_dummy_model_dir(args.preset, args.out, args.tokenizer_from,
                                  args.max_position_embeddings)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"{args.out}: {args.preset} shape, vocab {config.vocab_size}, bos {config.bos_token_id}, "
          f"eos {list(config.eos_token_ids)}; {size / 1e6:.1f} MB "
          f"({', '.join(sorted(os.listdir(args.out)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
