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


def run_step(policy, clock, batch, seconds, spec_tokens, decode_only=True, representative=True):
    """One synchronous engine step: decide, the step takes `seconds`, its results arrive."""
    planned_at = clock.now
    speculate = policy.speculate(batch)
    clock.now += seconds
    policy.step_ran(batch, speculate, spec_tokens if speculate else 1.0, decode_only, planned_at,
                    representative or speculate)
    return speculate


def _one(policy, clock, spec_s, plain_s, spec_tokens):
    planned_at = clock.now
    speculate = policy.speculate(1)
    clock.now += spec_s if speculate else plain_s
    policy.step_ran(1, speculate, spec_tokens if speculate else 1.0, True, planned_at)
    return speculate


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_budget_mode_always_speculates():
    clock = Clock()
    policy = SpecPolicy("budget", clock=clock)
    assert all(run_step(policy, clock, 64, 1.0 if i % 2 else 0.01, 1.0) for i in range(20))


def test_measures_both_sides_then_keeps_the_faster_and_explores_less_and_less():
    clock = Clock()
    # explore_budget=1: stretches every explore_every steps whatever they cost (below: the cost).
    policy = SpecPolicy(explore_every=8, min_spec_steps=1, min_plain_steps=1, explore_budget=1.0,
                        clock=clock)
    # Speculating: 2.5 tokens in 10 ms (250/s); plain: 1 token in 5 ms (200/s): speculate.
    choices = [_one(policy, clock, 0.010, 0.005, 2.5) for _ in range(70)]
    assert choices[:2] == [False, True]  # first each side is measured
    # Decided at step 3: a plain stretch of explore_plain_steps (3) 8 steps later; it changes
    # nothing, so the gap doubles: 16 steps after step 14, then 32 after step 33.
    plain = [i + 1 for i, c in enumerate(choices) if not c]
    assert plain == [1, 11, 12, 13, 30, 31, 32, 65, 66, 67]
    # Acceptance collapses: speculating now gives 1.1 tokens in 10 ms. Its moving average
    # falls below plain's 200 tok/s after two steps, and the policy turns speculation off.
    # The flip resets the gap: one-step explorations of speculating follow 8, 16 and 32 steps on.
    choices += [_one(policy, clock, 0.010, 0.005, 1.1) for _ in range(80)]
    assert [i + 1 for i, c in enumerate(choices) if c and i >= 70] == [71, 72, 81, 98, 131]


def test_learning_measures_plain_steps_then_speculates():
    clock = Clock()
    policy = SpecPolicy(clock=clock)  # 2 plain and 4 speculating steps before it decides
    choices = [run_step(policy, clock, 2, 0.050, 1.0) for _ in range(6)]
    assert choices == [False] * 2 + [True] * 4
    # Speculating measured 1 token in 50 ms against plain's 1 in 50 ms: not better, so plain.
    assert not run_step(policy, clock, 2, 0.050, 1.0)


def test_a_costly_side_is_learned_briefly_and_explored_seldom():
    # A draft model at a large batch: a speculating step takes 4x a plain one for 1.2 tokens.
    clock = Clock()
    policy = SpecPolicy(explore_every=32, clock=clock)
    choices = [run_step(policy, clock, 64, 0.020 if policy_side(policy) else 0.005, 1.2)
               for _ in range(400)]
    # Learning: 2 plain steps, then 2 speculating ones at 0.3x plain's rate end it early.
    assert choices[:5] == [False, False, True, True, False]
    # A one-step stretch of speculating costs 1 / 0.3 - 1 = 2.33 steps: at most 1% of the gap
    # makes it 234 steps (then 468).
    assert [i + 1 for i, c in enumerate(choices) if c][2:] == [239]


def policy_side(policy):
    """The side the next speculate() call will choose, without taking it (peeks at a copy)."""
    import copy
    return copy.deepcopy(policy).speculate(64)


def test_a_plain_step_that_fills_the_pipeline_is_not_measured():
    # Under async scheduling the first plain step after a speculating one ran without a step
    # in flight before it: its period is a synchronous step's, not the pipeline's.
    clock = Clock()
    policy = SpecPolicy(min_spec_steps=1, min_plain_steps=2, clock=clock)
    assert not run_step(policy, clock, 4, 0.030, 1.0, representative=False)
    assert policy.buckets[4].plain.count == 0
    assert not run_step(policy, clock, 4, 0.005, 1.0)
    assert not run_step(policy, clock, 4, 0.005, 1.0)
    assert policy.buckets[4].plain.seconds == pytest.approx(0.005)
    assert run_step(policy, clock, 4, 0.020, 3.0)
    assert not run_step(policy, clock, 4, 0.005, 1.0)  # 200 tok/s plain beats 150 speculating


def test_a_period_runs_from_the_previous_results_or_from_an_idle_plan():
    clock = Clock()
    policy = SpecPolicy(min_spec_steps=3, clock=clock)
    # Pipelined: step 2 was planned before step 1's results arrived; its period starts there.
    policy.speculate(8)
    clock.now = 1.000
    policy.step_ran(8, True, 2.0, True, planned_at=0.990)
    policy.speculate(8)
    clock.now = 1.004
    policy.step_ran(8, True, 2.0, True, planned_at=0.998)
    side = policy.buckets[8].spec
    assert side.seconds == pytest.approx(0.8 * 0.010 + 0.2 * 0.004)
    # Idle for a second: the next period starts at its plan, not at the last results.
    clock.now = 2.000
    policy.speculate(8)
    clock.now = 2.006
    policy.step_ran(8, True, 2.0, True, planned_at=2.000)
    assert side.seconds < 0.01


def test_batch_sizes_are_measured_apart():
    clock = Clock()
    policy = SpecPolicy(min_spec_steps=1, min_plain_steps=1, clock=clock)
    for batch, spec_s, plain_s in ((1, 0.010, 0.006), (64, 0.030, 0.008)):
        assert not run_step(policy, clock, batch, plain_s, 1.0)
        assert run_step(policy, clock, batch, spec_s, 3.0)
    assert policy.speculate(1) and not policy.speculate(64)  # 300 vs 167 tok/s; 100 vs 125


def test_steps_with_prefill_are_not_measured():
    clock = Clock()
    policy = SpecPolicy(clock=clock)
    run_step(policy, clock, 4, 5.0, 3.0, decode_only=False)
    assert policy.buckets[4].plain.seconds is None and policy.buckets[4].plain.count == 0


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


def test_steps_planned_to_speculate_count_even_when_nothing_was_proposed(tmp_path):
    # A proposer that never finds drafts (n-gram on text without repeats): the planned steps
    # still ran synchronously, so they are the speculating side, and the policy learns plain.
    from rooflm.spec.replay import ReplayProposer
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    llm = LLM(model=path, speculative_method="ngram", speculative_max_batch_tokens=512, device="cpu",
              dtype="float32", block_size=4, num_blocks=512)
    llm.engine.spec.set_proposer(ReplayProposer({}, 0.0, 256))  # no continuation: no drafts
    prompts = [[(7 * i + j) % 250 + 1 for j in range(12)] for i in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    measured = llm.engine.spec.policy.buckets[2]
    assert llm.engine.snapshot().spec.num_drafts == 0
    assert measured.spec.count >= 4 and measured.plain.count >= 2
