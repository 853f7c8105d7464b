"""The prefix cache's host tier end to end: a tiny Llama with 4-token blocks and a pool that
holds one request, so that a second prompt evicts the first one's cached blocks; the first
prompt's second pass then restores them from the host tier. Greedy tokens equal a cold run
and a run whose pool keeps everything, and the engine computes fewer tokens."""

import pytest

from rooflm import LLM, SamplingParams
from tests.models.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [(5 * j + 3) % 250 + 1 for j in range(41)]  # 10 whole blocks + 1 token
OTHER = [(11 * j + 7) % 250 + 1 for j in range(60)]
TIER_GB = 2**-10  # 1 MiB: hundreds of the tiny model's blocks


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tier"), "llama", initializer_range=0.3)
    return path


def engine_llm(path, device="cpu", dtype="float32", **kwargs):
    return LLM(model=path, device=device, dtype=dtype, block_size=4, **kwargs)


def run_three(llm):
    """PROMPT, OTHER (evicting PROMPT's blocks), PROMPT again: its tokens, its cached tokens
    and the tokens the engine computed for the second pass (step reports)."""
    computed = []
    llm.engine.add_observer(lambda report: computed.append(report.shape.num_tokens))
    first = llm.generate([PROMPT], GREEDY)[0]
    llm.generate([OTHER], GREEDY)
    computed.clear()
    second = llm.generate([PROMPT], GREEDY)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    return second.outputs[0].token_ids, second.num_cached_tokens, sum(computed)


def test_a_host_tier_hit_restores_equal_tokens_and_computes_fewer(tiny_path):
    # 18 blocks: one request (41 + 12 tokens = 14 blocks; OTHER 18) at a time.
    cold, cold_cached, cold_computed = run_three(engine_llm(tiny_path, num_blocks=18))
    tier = engine_llm(tiny_path, num_blocks=18, kv_offload_gb=TIER_GB)
    tokens, cached, computed = run_three(tier)
    ample, ample_cached, _ = run_three(engine_llm(tiny_path, num_blocks=256))
    assert tokens == cold == ample
    assert cold_cached == 0  # without the tier, OTHER evicted every block of PROMPT
    assert cached == ample_cached == 40
    # Computed: the prompt's uncached tokens, then one per generated token after the first.
    assert cold_computed == len(PROMPT) + GREEDY.max_tokens - 1
    assert computed == cold_computed - 40
    bm = tier.engine.block_manager
    assert bm.host_tier.num_restored >= 10 and bm.prefix_host_hits > 0
    snap = tier.engine.snapshot()
    assert snap.prefix_host_hit_tokens == bm.prefix_host_hits
    assert 0 < snap.num_offload_used_blocks <= tier.engine.info.num_offload_blocks == bm.host_tier.num_blocks


def test_the_cpu_device_has_no_tier_by_default(tiny_path):
    llm = engine_llm(tiny_path, num_blocks=18)
    assert llm.engine.block_manager.host_tier is None
    assert llm.engine.runner.host_kv_cache is None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_the_tier_matches_an_ample_pool(tiny_path, mode):
    """Shared prefixes, a pool far too small: requests are preempted (swapped or recomputed)
    while their prefixes move between the device and the host tier."""
    shared = PROMPT[:24]
    prompts = [shared + [(13 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(8)]
    ample = engine_llm(tiny_path, num_blocks=512)
    ref = [o.outputs[0].token_ids for o in ample.generate(prompts, GREEDY)]
    small = engine_llm(tiny_path, num_blocks=24, preemption_mode=mode, reserve_new_tokens=False,
                       kv_offload_gb=TIER_GB, swap_space_gb=TIER_GB)
    for _ in range(2):  # the second round finds the prefixes on the device or the host
        assert [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY)] == ref
    engine = small.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.host_tier.num_stored > 0
    assert engine.block_manager.num_free_blocks == 24


def test_a_tiny_tier_keeps_its_bound_and_stays_correct(tiny_path):
    """A tier of 3 blocks: evictions overflow it, LRU drops entries, tokens stay right."""
    cold, _, _ = run_three(engine_llm(tiny_path, num_blocks=18))
    block_bytes = engine_llm(tiny_path, num_blocks=18).engine.runner.kv_bytes_per_block()
    llm = engine_llm(tiny_path, num_blocks=18, kv_offload_gb=3.5 * block_bytes / 2**30)
    tier = llm.engine.block_manager.host_tier
    assert tier.num_blocks == 3 and llm.engine.runner.host_kv_cache.shape[0] == 3
    tokens, _, _ = run_three(llm)
    assert tokens == cold
    assert len(tier) == 3 and tier.num_evicted > 0


@pytest.mark.gpu
def test_tier_on_cuda_gives_equal_tokens(tiny_path):
    """The batched pinned copies on the device's stream: equal tokens with and without the
    tier, with async scheduling and CUDA graphs as served."""
    cold, _, cold_computed = run_three(engine_llm(tiny_path, device="cuda", dtype="bfloat16", num_blocks=18,
                                                  kv_offload_gb=0))
    llm = engine_llm(tiny_path, device="cuda", dtype="bfloat16", num_blocks=18, kv_offload_gb=TIER_GB)
    tokens, cached, computed = run_three(llm)
    assert tokens == cold and cached == 40 and computed == cold_computed - 40
    assert llm.engine.runner.host_kv_cache.is_pinned()


def test_sliding_window_groups_restore_from_the_tier(tmp_path):
    """A tiny Gemma 2 (an 8-token window in its own KV cache group): the second pass restores
    the full group's blocks and the sliding group's blocks of the window before the hit."""
    path, _ = make_tiny_model(tmp_path, "gemma2", initializer_range=0.3, tied=True)
    common = dict(max_model_len=128, num_blocks=36)  # OTHER alone takes 36
    cold, _, cold_computed = run_three(engine_llm(path, **common))
    llm = engine_llm(path, kv_offload_gb=TIER_GB, **common)
    assert llm.engine.runner.kv_layout.windows == (None, 8)
    tokens, cached, computed = run_three(llm)
    assert tokens == cold and cached == 40 and computed == cold_computed - 40
    assert llm.engine.block_manager.host_tier.num_restored > 10  # both groups' blocks
