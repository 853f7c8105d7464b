"""Speculative decoding's device loop (rooflm/spec/loop.py) on the CPU (fp32), run eagerly:
greedy outputs identical to plain decoding, the loop actually running, stops and max_tokens
cutting a step, the loop ending for a new request, an abort, a sampled request or a short
pool, and every block free at the end. Tiny random models, as test_spec_decode.py."""

import pytest

from rooflm import LLM, SamplingParams
from rooflm.spec.loop import loop_sampling
from rooflm.spec.replay import ReplayProposer
from tests.unit.test_spec_decode import (BASE, GREEDY, PROMPTS, SPEC, check_all_blocks_free, plain,  # noqa: F401
                                         prompts_of, reference, tiny_path, tokens)


@pytest.fixture(scope="module")
def loop_llm(tiny_path):
    return LLM(model=tiny_path, speculative_method="ngram", speculative_device_loop=True, **BASE, **SPEC)


def loop_steps(llm):
    return llm.engine.spec_loop.num_steps


def run_with(engine, action):
    """Step the engine to the end, doing `action` once, at the first step the loop is running;
    returns the finished outputs by request id."""
    done, acted = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not acted and engine.spec_loop.active_loop:
            action()
            acted = True
    assert acted, "the loop never ran"
    return done


def use_replay(llm, ref, prompts, corrupt):
    llm.engine.spec.set_proposer(ReplayProposer({tuple(p): o[0] for p, o in zip(prompts, ref)}, corrupt, 256, seed=3))


def use_ngram(llm):
    from rooflm.spec.ngram import NgramProposer
    llm.engine.spec.set_proposer(NgramProposer(4, 1))


def test_ngram_loop_gives_plain_greedy_outputs(loop_llm, reference):
    use_ngram(loop_llm)
    before = loop_steps(loop_llm)
    assert tokens(loop_llm.generate(PROMPTS, GREEDY)) == reference
    assert loop_steps(loop_llm) - before >= 5
    check_all_blocks_free(loop_llm)


@pytest.mark.parametrize("corrupt", [0.0, 0.2, 0.6])
def test_replayed_drafts_in_the_loop(loop_llm, reference, corrupt):
    use_replay(loop_llm, reference, PROMPTS, corrupt)
    stats0 = loop_llm.engine.spec.stats.snapshot()
    before = loop_steps(loop_llm)
    assert tokens(loop_llm.generate(PROMPTS, GREEDY)) == reference
    stats = loop_llm.engine.spec.stats.snapshot()
    accepted = stats.num_accepted_tokens - stats0.num_accepted_tokens
    steps = loop_steps(loop_llm) - before
    assert steps > 0
    if corrupt == 0.0:  # every draft right: each loop step emits k + 1 tokens a sequence
        assert accepted >= 0.7 * sum(len(r[0]) for r in reference)
        assert steps <= 30 // 5 + 2
    check_all_blocks_free(loop_llm)
    use_ngram(loop_llm)


@pytest.mark.parametrize("max_tokens", [11, 13, 17])
def test_max_tokens_and_stop_tokens_cut_a_loop_step(loop_llm, plain, reference, max_tokens):
    use_replay(loop_llm, reference, PROMPTS, 0.0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = loop_steps(loop_llm)
    got = tokens(loop_llm.generate(PROMPTS, params))
    assert got == tokens(plain.generate(PROMPTS, params))
    assert all(len(g[0]) == max_tokens for g in got)  # the device stopped each slot exactly there
    assert loop_steps(loop_llm) > before
    stop = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[r[0][max_tokens]])
            for r in reference]
    got = tokens(loop_llm.generate(PROMPTS, stop))
    assert got == tokens(plain.generate(PROMPTS, stop))
    assert all(g[0][-1] == s.stop_token_ids[0] for g, s in zip(got, stop))
    check_all_blocks_free(loop_llm)
    use_ngram(loop_llm)


def test_a_new_request_ends_the_loop_and_joins(loop_llm, plain, reference):
    """Requests added while the loop runs: it ends after the step in flight, the newcomers'
    prefill runs on the host path, and the loop comes back."""
    use_replay(loop_llm, reference, PROMPTS, 0.1)
    engine = loop_llm.engine
    entries = engine.spec_loop.num_entries
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[2], GREEDY)
    done = run_with(engine, lambda: engine.add_request("c", PROMPTS[1], GREEDY))
    assert engine.spec_loop.num_entries - entries >= 2
    assert [done[r].outputs[0].token_ids for r in "abc"] == [reference[0][0], reference[2][0], reference[1][0]]
    check_all_blocks_free(loop_llm)
    use_ngram(loop_llm)


def test_abort_inside_the_loop(loop_llm, reference):
    use_replay(loop_llm, reference, PROMPTS, 0.1)
    engine = loop_llm.engine
    engine.add_request("x", PROMPTS[0], GREEDY)
    engine.add_request("y", PROMPTS[2], GREEDY)
    done = run_with(engine, lambda: engine.abort_request("x"))
    assert "x" not in done
    assert done["y"].outputs[0].token_ids == reference[2][0]
    check_all_blocks_free(loop_llm)
    use_ngram(loop_llm)


def test_seeded_and_logprob_requests_stay_on_the_host_path(loop_llm, plain):
    """A seeded request (its own generator) or one that wants logprobs keeps the whole batch out
    of the loop."""
    sampled = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=5)  # outlives GREEDY
    logprobs = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    before = loop_steps(loop_llm)
    outs = loop_llm.generate(PROMPTS[:2], [GREEDY, sampled])
    lp = loop_llm.generate(PROMPTS[:2], logprobs)
    assert loop_steps(loop_llm) == before
    assert tokens([outs[0]]) == tokens(plain.generate(PROMPTS[:1], GREEDY))
    assert tokens(lp) == tokens(plain.generate(PROMPTS[:2], logprobs))
    check_all_blocks_free(loop_llm)


def test_a_short_pool_ends_the_loop_and_preempts_as_usual(tiny_path):
    prompts = prompts_of([40, 36, 44, 38], offset=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = dict(BASE, num_blocks=70)
    plain = LLM(model=tiny_path, **small)
    want = tokens(plain.generate(prompts, params))
    llm = LLM(model=tiny_path, speculative_method="ngram", speculative_device_loop=True, **small, **SPEC)
    use_replay(llm, want, prompts, 0.0)
    assert tokens(llm.generate(prompts, params)) == want
    assert loop_steps(llm) > 0 and llm.engine.scheduler.num_preemptions > 0
    check_all_blocks_free(llm)


def test_prefix_caching_with_the_loop(tiny_path, reference):
    llm = LLM(model=tiny_path, speculative_method="ngram", speculative_device_loop=True,
              enable_prefix_caching=True, **BASE, **SPEC)
    use_replay(llm, reference, PROMPTS, 0.2)
    for _ in range(2):  # the second round hits the blocks the first one cached
        assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    assert loop_steps(llm) > 0
    check_all_blocks_free(llm)


def test_the_loop_is_off_where_asked(tiny_path):
    llm = LLM(model=tiny_path, speculative_method="ngram", speculative_device_loop=False, **BASE, **SPEC)
    assert llm.engine.spec_loop is None
    auto = LLM(model=tiny_path, speculative_method="ngram", **BASE, **SPEC)
    assert auto.engine.spec_loop is None  # the CPU has no CUDA graphs: the host path by default


def test_which_requests_the_loop_takes(loop_llm):
    engine = loop_llm.engine
    cases = [(GREEDY, "greedy"), (SamplingParams(temperature=0.5), "temperature"),
             (SamplingParams(temperature=0.5, top_k=1), "greedy"),
             (SamplingParams(temperature=0.5, top_p=0.9), None), (SamplingParams(temperature=0.5, seed=3), None),
             (SamplingParams(temperature=0, logprobs=1), None), (SamplingParams(temperature=0, repetition_penalty=1.2), None),
             (SamplingParams(temperature=0, n=2), None), (SamplingParams(temperature=0, logit_bias={3: 1.0}), None),
             (SamplingParams(temperature=0, min_tokens=5, max_tokens=10), None)]
    for i, (params, mode) in enumerate(cases):
        assert loop_sampling(engine.add_request(f"q{i}", PROMPTS[0], params)) == mode, params
    engine.abort_request([f"q{i}" for i in range(len(cases))])
    check_all_blocks_free(loop_llm)


def test_sampled_requests_run_in_the_loop(loop_llm, reference):
    """Temperature sampling (no seed) runs in the loop beside greedy requests; the greedy ones
    keep plain decoding's tokens."""
    use_replay(loop_llm, reference, PROMPTS, 0.0)
    before = loop_steps(loop_llm)
    hot = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    outs = loop_llm.generate(PROMPTS[:3], [GREEDY, hot, GREEDY])
    assert loop_steps(loop_llm) > before and loop_llm.engine.spec_loop.num_entries > 0
    assert tokens([outs[0], outs[2]]) == [reference[0], reference[2]]
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    check_all_blocks_free(loop_llm)
    use_ngram(loop_llm)


def test_loop_sampling_keeps_the_target_distribution():
    """Many slots verify the same rows against fixed point-mass drafts, as in
    test_spec_rejection.py: the first emitted token follows p_0, the second (where draft 0 was
    accepted) p_1. Drawing a rejected row from p_j instead of its residual fails it."""
    import types

    import torch

    from rooflm.spec.loop import SpecLoop
    from tests.unit.test_spec_rejection import CHI2_CRIT_7, DRAWS, V, chi_square

    torch.manual_seed(2)
    k, temperature = 2, 0.7
    loop = SpecLoop(types.SimpleNamespace(block_size=4, device=torch.device("cpu")), k,
                    max_tokens=DRAWS * (k + 1), max_seqs=DRAWS, max_model_len=8)
    rows = torch.randn(k + 1, V) * 1.5
    p = torch.softmax(rows / temperature, dim=-1)
    guess = torch.tensor([int(p[0].argsort(descending=True)[1]), 0])  # the second most likely, then 0
    loop.drafts.copy_(guess.repeat(DRAWS, 1))
    loop.num_drafts.fill_(k)
    loop.lengths.fill_(2)
    loop.limit.fill_(8)
    loop.active.fill_(True)
    loop.inv_temp.fill_(1.0 / temperature)
    loop._prepare_torch(DRAWS)
    loop._accept(DRAWS, rows.repeat(DRAWS, 1), sampled=True)
    count, emitted = loop.pack[:, k + 1], loop.pack[:, :k + 1]
    assert 1 < count.float().mean() < k + 1  # both accepting and rejecting happened
    assert chi_square(emitted[:, 0], p[0]) < CHI2_CRIT_7
    second = emitted[count >= 2, 1]
    assert second.numel() > 2000 and chi_square(second, p[1]) < CHI2_CRIT_7
