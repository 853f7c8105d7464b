"""--deterministic on the GPU: bf16, exact. Every way of running the same requests gives
bit-identical tokens and logprobs: max_num_seqs 1 vs 64, a KV pool small enough to preempt
(recompute and swap) vs a big one, prefix caching on and off, chunks of 256 vs 2048 tokens,
CUDA graphs vs eager, async scheduling on and off, a request alone vs inside a full batch.

Small shape: Qwen3-0.6B (dummy weights; GQA 16/8, head dim 128, q/k head norms, tied LM head).
The Llama-3-8B shape is benchmarks/deterministic.sh's. Run with `pytest -m gpu`.
"""

import gc
import random

import pytest
import torch

from rooflm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MODEL = "qwen3-0.6b"


def workload():
    rng = random.Random(21)
    prompts = [[rng.randrange(1, 150000) for _ in range(rng.randint(100, 600))] for _ in range(24)]
    for i in range(0, 24, 4):  # every fourth prompt starts like the one before it: prefix-cache hits
        prompts[i + 1][:96] = prompts[i][:96]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(20, 120), ignore_eos=True, logprobs=2)
              for _ in prompts]
    # Seeded random sampling, n = 2: each sample draws from its own generator.
    params[5] = SamplingParams(temperature=0.8, top_p=0.95, seed=3, n=2, max_tokens=60, ignore_eos=True,
                               logprobs=2)
    return prompts, params


def run(prompts, params, **options):
    llm = LLM(model=MODEL, load_format="dummy", dtype="bfloat16", max_model_len=2048, deterministic=True,
              **options)
    outs = llm.generate(prompts, params)
    preemptions = llm.engine.snapshot().num_preemptions
    result = [[(c.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs])
               for c in o.outputs] for o in outs]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result, preemptions


@pytest.fixture(scope="module")
def batch_run():
    prompts, params = workload()
    result, _ = run(prompts, params, max_num_seqs=64)
    return prompts, params, result


def first_difference(a, b) -> str:
    for r, (x, y) in enumerate(zip(a, b)):
        if x != y:
            tokens_equal = [c[0] for c in x] == [c[0] for c in y]
            return f"request {r} differs ({'logprobs only' if tokens_equal else 'tokens'})"
    return "none"


VARIANTS = {
    "max_num_seqs 1": dict(max_num_seqs=1),
    "preempt by recompute": dict(max_num_seqs=64, num_blocks=160, block_size=16, preemption_mode="recompute",
                                 reserve_new_tokens=False),
    "preempt by swap": dict(max_num_seqs=64, num_blocks=160, block_size=16, preemption_mode="swap", swap_space_gb=4.0,
                            reserve_new_tokens=False),
    "prefix caching off": dict(max_num_seqs=64, enable_prefix_caching=False),
    "chunks of 256": dict(max_num_seqs=64, max_num_batched_tokens=256),
    "eager": dict(max_num_seqs=64, enforce_eager=True),
    "async scheduling off": dict(max_num_seqs=64, async_scheduling=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deterministic_outputs_identical(batch_run, variant):
    prompts, params, base = batch_run
    other, preemptions = run(prompts, params, **VARIANTS[variant])
    if variant.startswith("preempt"):
        assert preemptions > 0, "the small pool did not preempt: the test would prove nothing"
    assert other == base, first_difference(base, other)


def test_request_alone_equals_request_in_full_batch(batch_run):
    prompts, params, base = batch_run
    alone, _ = run(prompts[7:8], params[7:8], max_num_seqs=64)
    assert alone[0] == base[7]


def test_batch_invariant_kernels_are_in_use():
    llm = LLM(model=MODEL, load_format="dummy", dtype="bfloat16", max_model_len=512, deterministic=True,
              max_num_seqs=8)
    model = llm.engine.runner.model
    assert llm.engine.runner.backend.deterministic
    assert model.model.layers[0].gemv is None and model.linear is not None
    assert model.model.layers[0].mlp.gate_up_proj.kernel is not None
    del llm
    gc.collect()
    torch.cuda.empty_cache()
