"""Greedy tokens of a tiny random Llama, CUDA graphs vs eager, at KV block sizes 16 and 64 (batch 1..8):
the first token index where they part, per batch size. Usage: python benchmarks/graphs_vs_eager.py"""

import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())

from rooflm import LLM, SamplingParams  # noqa: E402
from tests.models.tiny_models import make_tiny_model  # noqa: E402

PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 40, 17, 97, 1, 64, 33, 8])]


def tokens(path, batch, eager, block_size, **kw):
    llm = LLM(model=path, device="cuda", dtype="bfloat16", enforce_eager=eager, block_size=block_size, **kw)
    outs = llm.generate(PROMPTS[:batch], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    del llm
    return [o.outputs[0].token_ids for o in outs]


def first_diff(a, b):
    return min((i for x, y in zip(a, b) for i, (p, q) in enumerate(zip(x, y)) if p != q), default=None)


with tempfile.TemporaryDirectory() as tmp:
    path, _ = make_tiny_model(tmp, "llama", initializer_range=0.3)
    for block_size in (16, 64):
        for batch in (1, 2, 4, 8):
            e = tokens(path, batch, True, block_size)
            g = tokens(path, batch, False, block_size, piecewise_cuda_graphs=False)
            print(f"block {block_size} batch {batch}: graphs vs eager first difference at token {first_diff(e, g)}",
                  flush=True)
