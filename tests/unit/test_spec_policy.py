"""The speculation policy (rooflm/spec/policy.py): speculate at a batch size only while
speculating steps have measured more tokens per second than plain ones there."""

import pytest

from rooflm import LLM, SamplingParams
from rooflm.spec.policy import SpecPolicy, bucket
from tests.models.tiny_models import make_tiny_model


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_step(policy, clock, batch, seconds, spec_tokens, decode_only=True):
    """One engine step: plan (decide), the step takes `seconds`, then observe."""
    policy.begin_step()
    speculate = policy.speculate(batch)
    clock.now += seconds
    policy.step_ran(batch, speculate, spec_tokens if speculate else 1.0, decode_only)
    return speculate


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_budget_mode_always_speculates():
    clock = Clock()
    policy = SpecPolicy("budget", clock=clock)
    assert all(run_step(policy, clock, 64, 1.0 if i % 2 else 0.01, 1.0) for i in range(20))


def test_measures_both_sides_then_keeps_the_faster_and_explores():
    clock = Clock()
    policy = SpecPolicy(explore_every=8, min_spec_steps=1, min_plain_steps=1, clock=clock)
    # Speculating: 2.5 tokens in 10 ms (250/s); plain: 1 token in 5 ms (200/s): speculate.
    choices = [run_step(policy, clock, 1, 0.010, 2.5), run_step(policy, clock, 1, 0.005, 2.5)]
    assert choices == [True, False]  # first each side is measured
    for _ in range(30):
        policy.begin_step()
        speculate = policy.speculate(1)
        clock.now += 0.010 if speculate else 0.005
        policy.step_ran(1, speculate, 2.5 if speculate else 1.0, True)
        choices.append(speculate)
    assert choices[2:].count(False) == 4  # the bucket's steps 8, 16, 24 and 32 explore
    # Acceptance collapses: speculating now gives 1.1 tokens in 10 ms; the policy switches off.
    for _ in range(40):
        policy.begin_step()
        speculate = policy.speculate(1)
        clock.now += 0.010 if speculate else 0.005
        policy.step_ran(1, speculate, 1.1 if speculate else 1.0, True)
        choices.append(speculate)
    assert choices[-16:].count(True) <= 2  # off, but for exploration


def test_learning_speculates_with_a_plain_step_every_fourth():
    clock = Clock()
    policy = SpecPolicy(clock=clock)  # 8 speculating and 2 plain steps before it decides
    choices = [run_step(policy, clock, 2, 0.050, 1.0) for _ in range(10)]
    assert choices == [True, True, True, False, True, True, True, False, True, True]
    # Speculating measured 1 token in 50 ms against plain's 1 in 50 ms: not better, so plain.
    assert not run_step(policy, clock, 2, 0.050, 1.0)


def test_batch_sizes_are_measured_apart():
    clock = Clock()
    policy = SpecPolicy(min_spec_steps=1, min_plain_steps=1, clock=clock)
    for batch, spec_s, plain_s in ((1, 0.010, 0.006), (64, 0.030, 0.008)):
        policy.begin_step()
        assert policy.speculate(batch)
        clock.now += spec_s
        policy.step_ran(batch, True, 3.0, True)
        policy.begin_step()
        assert not policy.speculate(batch)
        clock.now += plain_s
        policy.step_ran(batch, False, 1.0, True)
    policy.begin_step()
    assert policy.speculate(1) and not policy.speculate(64)  # 300 vs 167 tok/s; 100 vs 125


def test_steps_with_prefill_are_not_measured():
    clock = Clock()
    policy = SpecPolicy(clock=clock)
    run_step(policy, clock, 4, 5.0, 3.0, decode_only=False)
    policy.begin_step()
    assert policy.buckets[4].spec.seconds is None


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="adaptive or budget"):
        SpecPolicy("sometimes")
    with pytest.raises(ValueError, match="speculative_policy"):
        LLM(model="none", speculative_method="ngram", speculative_policy="sometimes")


def test_engine_measures_both_sides_and_stays_lossless(tmp_path):
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    prompts = [[(7 * i + 3 * (j % 11)) % 250 + 1 for j in range(n)] for i, n in enumerate([37, 21, 9])]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", block_size=4, num_blocks=512)
    ref = [o.outputs[0].token_ids for o in LLM(model=path, **base).generate(prompts, params)]
    llm = LLM(model=path, speculative_method="ngram", speculative_max_batch_tokens=512, **base)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == ref
    measured = llm.engine.spec.policy.buckets[bucket(len(prompts))]
    assert measured.spec.seconds is not None and measured.plain.seconds is not None
    llm.engine.spec.reset_policy()  # benchmarks: each variant learns afresh, in the same mode
    assert llm.engine.spec.policy.buckets == {} and llm.engine.spec.policy.mode == "adaptive"
