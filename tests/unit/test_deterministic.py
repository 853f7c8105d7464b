"""--deterministic on the CPU engine (rooflm/deterministic/): a request's tokens and logprobs are
bit-identical whatever else runs beside it and however the engine schedules it.

Without the flag these comparisons fail on the CPU too: the same tiny model gives the same
greedy tokens but logprobs that differ in their last bits between max_num_seqs 8 and 1, or
between whole and chunked prefills (torch's matmul and SDPA sum by the batch's shape).
"""

import pytest
import torch

from rooflm import LLM, SamplingParams
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("det"), "llama", initializer_range=0.3)
    return path


def requests():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 29, 17, 24)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    # A seeded random request with n = 2: each sample draws from its own generator.
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=6, ignore_eos=True, logprobs=2)
    # The first two prompts share a 12-token head (a prefix-cache hit of 3 blocks).
    prompts[1][:12] = prompts[3][:12]
    return prompts, [greedy, greedy, seeded, greedy]


def run(path, **kw):
    prompts, params = requests()
    llm = LLM(model=path, device="cpu", dtype="float32", block_size=4, deterministic=True, **kw)
    outs = llm.generate(prompts, params)
    run.preemptions = llm.engine.snapshot().num_preemptions
    return [[(c.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


def test_deterministic_cpu_outputs_do_not_depend_on_batching(tiny_llama):
    base = run(tiny_llama, max_num_seqs=8)
    assert len(base[2]) == 2 and base[2][0][0] != base[2][1][0]  # two different samples
    # One request at a time, prompts chunked 8 tokens a step, no prefix cache.
    assert run(tiny_llama, max_num_seqs=1, max_num_batched_tokens=8, enable_prefix_caching=False) == base
    # A pool of 12 blocks (48 tokens) for ~110, admission without growth room: requests are
    # preempted, by swapping and by recomputing.
    assert run(tiny_llama, num_blocks=12, preemption_mode="swap", max_num_batched_tokens=16,
               reserve_new_tokens=False) == base
    assert run.preemptions > 0
    assert run(tiny_llama, num_blocks=12, preemption_mode="recompute", reserve_new_tokens=False) == base
    assert run.preemptions > 0


def test_deterministic_cpu_wiring_and_closeness_to_default(tiny_llama):
    llm = LLM(model=tiny_llama, device="cpu", dtype="float32", block_size=4, deterministic=True)
    runner = llm.engine.runner
    assert runner.backend.name == "reference-rowwise"
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.kernel is not None and layer.gemv is None
    prompts, params = requests()
    default = LLM(model=tiny_llama, device="cpu", dtype="float32", block_size=4)
    a = llm.generate(prompts[:2], params[0])
    b = default.generate(prompts[:2], params[0])
    for x, y in zip(a, b):  # the same math, summed in another order: equal up to rounding
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for dx, dy in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert all(abs(dx[t].logprob - dy[t].logprob) < 1e-4 for t in dx if t in dy)
