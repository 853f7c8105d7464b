"""Speculative decoding on the CPU (fp32): greedy outputs identical to plain decoding.

Every proposer (n-gram, draft model, and the replay proposer whose acceptance is set) under
stop tokens, max_tokens, n > 1, preemption, prefix caching, chunked prefill, logprobs; the
KV pool ends with every block free. Tiny random models (2 layers, hidden 64).
"""

import numpy as np
import pytest

from rooflm import LLM, SamplingParams
from rooflm.spec.ngram import NgramIndex, lookup
from rooflm.spec.replay import ReplayProposer
from tests.models.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
# Big enough that the CPU's batch policy does not switch speculation off in these tests; the
# budget policy: these tests are about the mechanism, not when it pays (test_spec_policy.py).
SPEC = dict(speculative_max_batch_tokens=512, speculative_policy="budget")
BASE = dict(device="cpu", dtype="float32", block_size=4, num_blocks=512)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.3)
    return path


@pytest.fixture(scope="module")
def other_path(tmp_path_factory):
    """Another random model of the same vocabulary: a draft that is right only sometimes."""
    path, _ = make_tiny_model(tmp_path_factory.mktemp("other"), "llama", initializer_range=0.3, seed=1)
    return path


def prompts_of(lengths, offset=0):
    # Repeating patterns give the n-gram proposer something to find.
    return [[(7 * i + 3 * (j % 11) + offset) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]


PROMPTS = prompts_of([37, 21, 50, 9, 5])


def tokens(outputs):
    return [[o.token_ids for o in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def plain(tiny_path):
    return LLM(model=tiny_path, **BASE)


@pytest.fixture(scope="module")
def reference(plain):
    return tokens(plain.generate(PROMPTS, GREEDY))


def spec_llm(tiny_path, method, other_path=None, **kwargs):
    opts = {**BASE, **SPEC, **kwargs}
    if method == "draft-same":
        return LLM(model=tiny_path, speculative_method="draft", draft_model=tiny_path, **opts)
    if method == "draft-other":
        return LLM(model=tiny_path, speculative_method="draft", draft_model=other_path, **opts)
    return LLM(model=tiny_path, speculative_method="ngram", **opts)


def with_replay(llm, reference_tokens, prompts, corrupt):
    continuations = {tuple(p): out[0] for p, out in zip(prompts, reference_tokens)}
    llm.engine.spec.set_proposer(ReplayProposer(continuations, corrupt, 256, seed=3))
    return llm


def check_all_blocks_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# ---- the n-gram lookup ----------------------------------------------------------------------------


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # Suffix (2, 3) last occurred at 5..6, followed by 7, 5, 2, 3; (1, 2, 3) is not a suffix.
    assert lookup(t, 3, 4, 1) == [7, 5, 2]
    assert lookup(t, 10, 4, 1) == [7, 5, 2, 3]
    assert lookup(np.array([4, 5, 6]), 3, 3, 1) == []  # nothing repeats
    assert lookup(np.array([8, 1, 8]), 2, 3, 2) == []  # only 1-grams repeat, min is 2
    assert lookup(np.array([8, 1, 8]), 2, 3, 1) == [1, 8]


def test_incremental_index_finds_what_the_scan_finds():
    # Small vocabularies make repeats (and several candidate n) common; tokens arrive 1-4 at a
    # time, as accepted drafts do.
    rng = np.random.default_rng(0)
    for vocab, n_min, n_max in [(3, 1, 4), (5, 2, 3), (50, 1, 2)]:
        tokens = rng.integers(0, vocab, 5).tolist()
        index = NgramIndex(n_min, n_max)
        while len(tokens) < 160:
            k = int(rng.integers(1, 6))
            assert index.lookup(tokens, k) == lookup(np.array(tokens), k, n_max, n_min), tokens
            tokens += rng.integers(0, vocab, int(rng.integers(1, 5))).tolist()


# ---- greedy: identical to plain decoding ----------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft-same", "draft-other"])
def test_greedy_outputs_are_identical(tiny_path, other_path, reference, method):
    llm = spec_llm(tiny_path, method, other_path)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    check_all_blocks_free(llm)
    stats = llm.engine.snapshot().spec
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    if method == "draft-same":  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.mean_accepted_length > 3


@pytest.mark.parametrize("corrupt", [0.0, 0.3, 1.0])
def test_replayed_drafts_at_set_acceptance_give_identical_outputs(tiny_path, reference, corrupt):
    llm = with_replay(spec_llm(tiny_path, "ngram"), reference, PROMPTS, corrupt)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    check_all_blocks_free(llm)
    stats = llm.engine.snapshot().spec
    if corrupt == 0.0:
        assert stats.acceptance_rate == 1.0
    elif corrupt == 1.0:
        assert stats.num_accepted_tokens == 0
    else:
        assert 0.3 < stats.acceptance_rate < 0.9


def test_stop_tokens_and_max_tokens_cut_a_proposal(tiny_path, plain, reference):
    """The target drafting for itself accepts every draft, so a stop token or max_tokens lands
    inside an accepted run: the output must stop exactly where plain decoding stops."""
    stop_at = reference[0][0][13]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]
    prompts = PROMPTS[:3]
    ref = plain.generate(prompts, params)
    llm = spec_llm(tiny_path, "draft-same")
    out = llm.generate(prompts, params)
    assert tokens(out) == tokens(ref)
    assert [o.outputs[0].finish_reason for o in out] == ["stop", "length", "length"]
    assert len(out[1].outputs[0].token_ids) == 7
    check_all_blocks_free(llm)


def test_n_greater_than_one_forks_and_speculates(tiny_path, plain):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3)
    prompts = PROMPTS[:2] + [[17]]  # a one-token prompt forks at its first sample
    ref = tokens(plain.generate(prompts, params))
    for method in ("ngram", "draft-same"):
        llm = spec_llm(tiny_path, method)
        assert tokens(llm.generate(prompts, params)) == ref
        check_all_blocks_free(llm)


def test_preemption_with_speculation(tiny_path, plain):
    lengths = [37, 21, 50, 9, 44, 30, 17, 26, 33, 12, 48, 25]
    prompts = prompts_of(lengths)
    ref = tokens(plain.generate(prompts, GREEDY))
    need = sum(-(-(n + GREEDY.max_tokens) // 4) for n in lengths)
    for mode in ("recompute", "swap"):
        for method in ("ngram", "draft-same"):
            llm = spec_llm(tiny_path, method, num_blocks=need // 8, preemption_mode=mode,
                           reserve_new_tokens=False)
            assert tokens(llm.generate(prompts, GREEDY)) == ref, (mode, method)
            assert llm.engine.scheduler.num_preemptions > 0
            check_all_blocks_free(llm)


def test_prefix_cache_hits_and_chunked_prefill_alongside(tiny_path, plain):
    prompts = prompts_of([40, 33, 60, 12])
    ref = tokens(plain.generate(prompts, GREEDY))
    llm = spec_llm(tiny_path, "ngram", max_num_batched_tokens=16)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert tokens(first) == ref and tokens(second) == ref
    assert second[0].num_cached_tokens > 0
    check_all_blocks_free(llm)


def test_draft_model_with_prefix_hits_and_chunked_prefill(tiny_path, other_path, plain):
    prompts = prompts_of([40, 33, 60, 12])
    ref = tokens(plain.generate(prompts, GREEDY))
    llm = spec_llm(tiny_path, "draft-other", other_path, max_num_batched_tokens=16)
    first = llm.generate(prompts, GREEDY)
    # A new prompt arriving while others decode: its chunks run beside verify steps.
    second = llm.generate(prompts[::-1], GREEDY)
    assert tokens(first) == ref and tokens(second) == ref[::-1]
    assert second[0].num_cached_tokens > 0
    check_all_blocks_free(llm)


def test_logprobs_of_accepted_tokens_match_plain_decoding(tiny_path, plain):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    ref = plain.generate(PROMPTS[:2], params)
    out = spec_llm(tiny_path, "draft-same").generate(PROMPTS[:2], params)
    for r, o in zip(ref, out):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lo in zip(r.outputs[0].logprobs, o.outputs[0].logprobs):
            assert lr.keys() == lo.keys()
            for tid in lr:
                assert lo[tid].logprob == pytest.approx(lr[tid].logprob, abs=1e-4)
                assert lo[tid].rank == lr[tid].rank


def test_seeded_random_sampling_is_reproducible(tiny_path):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, ignore_eos=True, seed=7)
    for method in ("ngram", "draft-same"):
        a = tokens(spec_llm(tiny_path, method).generate(PROMPTS[:3], params))
        b = tokens(spec_llm(tiny_path, method).generate(PROMPTS[:3], params))
        assert a == b


# ---- async scheduling: plain steps pipelined, verify steps synchronous ------------------------------


def assert_same_outputs(outputs, reference):
    """Token ids exactly; logprobs to fp32 rounding (a verify forward sums in another order)."""
    assert tokens(outputs) == tokens(reference)
    for out, ref in zip(outputs, reference):
        for o, r in zip(out.outputs, ref.outputs):
            for lo, lr in zip(o.logprobs or (), r.logprobs or ()):
                assert lo.keys() == lr.keys()
                assert [lo[t].logprob for t in lo] == pytest.approx([lr[t].logprob for t in lo], abs=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft-other"])
@pytest.mark.parametrize("policy", ["adaptive", "budget"])
def test_async_scheduling_with_speculation_is_lossless(tiny_path, other_path, plain, method, policy):
    # Under the adaptive policy a bucket speculates 8 steps, then runs plain ones (pipelined),
    # then keeps the faster side: both kinds of step and the switches between them are run.
    prompts = PROMPTS + prompts_of([14, 29], offset=5)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=35, ignore_eos=True, repetition_penalty=1.2)]
    params = [params[i % 3] for i in range(len(prompts))]
    ref = plain.generate(prompts, params)
    llm = spec_llm(tiny_path, method, other_path, async_scheduling=True, speculative_policy=policy)
    assert llm.engine.async_scheduling
    assert_same_outputs(llm.generate(prompts, params), ref)
    check_all_blocks_free(llm)
    assert llm.engine.snapshot().spec.num_drafts > 0
    if policy == "adaptive":  # plain steps were measured, which needs one launched behind another
        assert any(b.plain.count for b in llm.engine.spec.policy.buckets.values())


def test_async_speculation_under_preemption_and_seeds(tiny_path, plain):
    lengths = [37, 21, 50, 9, 44, 30, 17, 26, 33, 12, 48, 25]
    prompts = prompts_of(lengths)
    ref = tokens(plain.generate(prompts, GREEDY))
    need = sum(-(-(n + GREEDY.max_tokens) // 4) for n in lengths)
    llm = spec_llm(tiny_path, "ngram", num_blocks=need // 8, reserve_new_tokens=False,
                   async_scheduling=True, speculative_policy="adaptive")
    assert tokens(llm.generate(prompts, GREEDY)) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    check_all_blocks_free(llm)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, ignore_eos=True, seed=7)
    sync = tokens(spec_llm(tiny_path, "ngram").generate(PROMPTS[:3], seeded))
    assert tokens(llm.generate(PROMPTS[:3], seeded)) == sync


def test_the_batch_policy_shortens_k_then_switches_speculation_off(tiny_path):
    llm = LLM(model=tiny_path, speculative_method="ngram", speculative_max_batch_tokens=16, **BASE)
    spec = llm.engine.spec
    assert spec.num_drafts_per_seq(1) == 4  # k = num_speculative_tokens
    assert spec.num_drafts_per_seq(4) == 3  # 4 x (1 + 3) = 16 tokens
    assert spec.num_drafts_per_seq(8) == 1
    assert spec.num_drafts_per_seq(9) == 0  # not even one draft each: off
    # Off for a batch of 9, outputs still identical and nothing drafted.
    prompts = prompts_of([10] * 9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = tokens(LLM(model=tiny_path, **BASE).generate(prompts, params))
    assert tokens(llm.generate(prompts, params)) == ref
    assert llm.engine.snapshot().spec.num_draft_tokens == 0


def test_bad_speculative_options_are_refused(tiny_path):
    with pytest.raises(ValueError, match="draft_model"):
        LLM(model=tiny_path, speculative_method="draft", **BASE)
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(model=tiny_path, speculative_method="medusa", **BASE)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=tiny_path, speculative_method="ngram", num_speculative_tokens=0, **BASE)
