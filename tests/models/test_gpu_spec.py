"""Speculative decoding on the GPU (Triton kernels, graphs): greedy outputs match plain decoding.

The verify forward runs the prefill kernel (in the uniform CUDA graphs) over 1 + k tokens where plain
decoding runs the decode kernel over one, so float results differ in the last bits: tokens are
identical, or at the first divergence each side's token is in the other's top-5; with
--deterministic they are identical, logprobs too. Run with `pytest -m gpu`."""

import pytest
import torch

from rooflm import LLM, SamplingParams
from tests.models.test_gpu_e2e import PROMPTS, check_greedy_close
from tests.models.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)


def run(path, dtype, **kw):
    llm = LLM(model=path, device="cuda", dtype=dtype, block_size=16, num_blocks=256, **kw)
    outs = llm.generate(PROMPTS, PARAMS)
    stats = llm.engine.snapshot().spec
    free = llm.engine.snapshot().num_free_blocks
    del llm
    torch.cuda.empty_cache()
    return outs, stats, free


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_spec_decode_matches_plain_on_gpu(tmp_path, dtype, method):
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    ref, _, _ = run(path, dtype)
    kw = dict(speculative_method=method, speculative_max_batch_tokens=512, speculative_policy="budget")
    if method == "draft":
        kw["draft_model"] = path  # the target drafting for itself: most drafts are accepted
    out, stats, free = run(path, dtype, **kw)
    check_greedy_close(out, ref)
    assert free == 256
    assert stats.num_drafts > 0
    if method == "draft":
        assert stats.acceptance_rate > 0.5


def test_seeded_sampling_reproducible_on_gpu(tmp_path):
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    params = SamplingParams(temperature=0.9, max_tokens=32, ignore_eos=True, seed=11)
    outs = []
    for _ in range(2):
        llm = LLM(model=path, device="cuda", dtype="float32", speculative_method="draft", draft_model=path,
                  speculative_max_batch_tokens=512, num_blocks=256, block_size=16)
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_spec_decode_is_exact_in_deterministic_mode(tmp_path, method):
    """--deterministic makes every row's sums independent of the rows beside it, so a verify
    forward scores each token exactly as a plain decode step would: tokens and logprobs equal."""
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    ref, _, _ = run(path, "bfloat16", deterministic=True)
    kw = dict(speculative_method=method)
    if method == "draft":
        kw["draft_model"] = path
    out, stats, free = run(path, "bfloat16", deterministic=True, **kw)
    assert stats.num_drafts > 0 and free == 256
    for a, b in zip(out, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_verify_steps_replay_the_uniform_graphs(tmp_path):
    """Verify forwards (1 + k tokens a sequence) run as one CUDA graph, and give what the eager
    path gives."""
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    kw = dict(device="cuda", dtype="bfloat16", block_size=16, num_blocks=256, speculative_method="draft",
              draft_model=path, speculative_policy="budget")
    llm = LLM(model=path, **kw)
    graphs = llm.engine.runner.uniform_graphs
    assert graphs is not None and graphs.graphs
    replays = []
    original = graphs.run

    def counting_run(choice, *args):
        replays.append(choice)
        return original(choice, *args)

    graphs.run = counting_run
    outs = llm.generate(PROMPTS, PARAMS)
    stats = llm.engine.snapshot().spec
    del llm
    torch.cuda.empty_cache()
    assert len(replays) > stats.num_drafts // (2 * len(PROMPTS))  # most verify steps replayed a graph
    eager, _, _ = run(path, "bfloat16", enforce_eager=True, speculative_method="draft", draft_model=path)
    check_greedy_close(outs, eager)


GREEDY_PLAIN = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)  # no logprobs: the loop's


def plain_reference_and_loop_engine(tmp_path):
    """A tiny model's deterministic plain greedy tokens, and an n-gram engine with the device loop."""
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, num_blocks=256, deterministic=True)
    plain = LLM(model=path, **common)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY_PLAIN)]
    del plain
    return ref, LLM(model=path, speculative_method="ngram", speculative_max_batch_tokens=512, **common)


def test_device_loop_is_exact_in_deterministic_mode(tmp_path):
    """The device loop (spec/loop.py, CUDA graphs) with n-gram drafts and with replayed ones
    (most accepted): tokens identical to plain decoding under --deterministic."""
    from rooflm.spec.replay import ReplayProposer
    ref, llm = plain_reference_and_loop_engine(tmp_path)
    loop = llm.engine.spec_loop
    assert loop is not None and loop.graphs
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY_PLAIN)] == ref
    ngram_steps, before = loop.num_steps, llm.engine.snapshot().spec
    llm.engine.spec.set_proposer(ReplayProposer({tuple(p): r for p, r in zip(PROMPTS, ref)}, 0.2, 256))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY_PLAIN)] == ref
    stats = llm.engine.snapshot()
    del llm
    torch.cuda.empty_cache()
    assert ngram_steps > 0 and loop.num_steps > ngram_steps
    accepted = stats.spec.num_accepted_tokens - before.num_accepted_tokens
    proposed = stats.spec.num_draft_tokens - before.num_draft_tokens
    assert accepted > 0.5 * proposed and stats.num_free_blocks == 256


def test_device_loop_matches_the_host_path(tmp_path):
    """Default mode: the loop's greedy tokens are the host verify path's, or at the first
    divergence the loop's token is in the host path's top 5 (a near-tie broken another way)."""
    from rooflm.spec.replay import ReplayProposer
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    llm = LLM(model=path, device="cuda", dtype="bfloat16", block_size=16, num_blocks=256,
              speculative_method="ngram", speculative_policy="budget")
    host = llm.generate(PROMPTS, PARAMS)  # logprobs: every step on the host path
    assert llm.engine.spec_loop.num_steps == 0
    llm.engine.spec.set_proposer(ReplayProposer(
        {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, host)}, 0.1, 256))
    looped = llm.generate(PROMPTS, GREEDY_PLAIN)
    steps, free = llm.engine.spec_loop.num_steps, llm.engine.snapshot().num_free_blocks
    del llm
    torch.cuda.empty_cache()
    assert steps > 0 and free == 256
    for a, b in zip(looped, host):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(ta) == 48
        diverged = next((i for i, (p, q) in enumerate(zip(ta, tb)) if p != q), None)
        if diverged is not None:
            assert ta[diverged] in b.outputs[0].logprobs[diverged], f"diverged at {diverged}"


def test_device_loop_samples_beside_greedy_on_gpu(tmp_path):
    """Temperature sampling in the loop's sampled graphs: the batch runs in the loop, the greedy
    requests beside the sampled ones keep their tokens (deterministic mode), every block comes back."""
    from rooflm.spec.replay import ReplayProposer
    ref, llm = plain_reference_and_loop_engine(tmp_path)
    loop = llm.engine.spec_loop
    assert any(sampled for _, sampled in loop.graphs)
    llm.engine.spec.set_proposer(ReplayProposer({tuple(p): r for p, r in zip(PROMPTS, ref)}, 0.1, 256))
    hot = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True)
    params = [GREEDY_PLAIN if i % 2 == 0 else hot for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    steps, free = loop.num_steps, llm.engine.snapshot().num_free_blocks
    del llm
    torch.cuda.empty_cache()
    assert steps > 0 and free == 256
    for i, o in enumerate(outs):
        assert len(o.outputs[0].token_ids) == 48
        if i % 2 == 0:
            assert o.outputs[0].token_ids == ref[i]
