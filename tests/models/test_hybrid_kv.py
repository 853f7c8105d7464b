"""Sliding-window layers holding only their window (engine/kv_groups.py), end to end: a tiny
Gemma 2 (4 layers alternating an 8-token window and full attention) with 4-token blocks, over
prompts several windows long, so that the sliding group gives blocks back every few tokens.
Greedy output with KV cache groups equals the output with one shared table and HF's."""

import pytest

from rooflm import LLM, SamplingParams
from tests.models.test_hf_parity import hf_greedy
from tests.models.tiny_models import make_tiny_model

NEW_TOKENS = 24
PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 3, 250, 7] * 5, list(range(100, 103))]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hybrid"), "gemma2", initializer_range=0.3, tied=True)


def _generate(path, prompts, **engine):
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_model_len=128, **engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return outs, llm


def test_groups_hold_only_the_window_and_match_one_table_and_hf(gemma2):
    path, hf_model = gemma2
    hybrid, llm = _generate(path, PROMPTS)
    runner, bm = llm.engine.runner, llm.engine.block_manager
    assert runner.kv_layout.windows == (None, 8)
    assert runner.kv_layout.group_size == 2
    assert runner.kv_cache.shape[0] == 2  # two layers a block
    shared, llm_off = _generate(path, PROMPTS, disable_hybrid_kv_cache_manager=True)
    assert llm_off.engine.runner.kv_layout.windows == (None,)
    assert hybrid == shared
    for prompt, tokens in zip(PROMPTS, hybrid):
        assert tokens == hf_greedy(hf_model, prompt, NEW_TOKENS)[0]
    assert bm.num_free_blocks == bm.num_blocks  # every block came back


def test_prefix_hit_through_the_window_matches_a_cold_run(gemma2):
    """The second prompt shares 32 tokens with the first: its hit must bring the sliding group's
    blocks of the window before the hit point, and the output must equal a run without cache."""
    path, _ = gemma2
    first = list(range(30, 70))
    second = list(range(30, 62)) + [7, 8, 9, 10, 11]
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([first], params)
    warm = llm.generate([second], params)[0]
    assert warm.num_cached_tokens == 32  # 8 whole blocks; the sliding group's last 2 came with them
    cold, _ = _generate(path, [second], enable_prefix_caching=False)
    assert warm.outputs[0].token_ids == cold[0]


@pytest.mark.parametrize("scales", ["per-token", "static"])
def test_fp8_cache_with_groups_equals_one_table(gemma2, scales):
    """FP8 scales: per-token ones live in the block's pool slot, static ones belong to the layer."""
    path, _ = gemma2
    fp8 = dict(kv_cache_dtype="fp8", kv_cache_scales=scales)
    hybrid, _ = _generate(path, PROMPTS[:2], **fp8)
    shared, _ = _generate(path, PROMPTS[:2], disable_hybrid_kv_cache_manager=True, **fp8)
    assert hybrid == shared


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_groups_equals_one_table(gemma2, mode):
    """A pool too small for the batch: requests are preempted (recomputed or swapped out with
    every group's blocks) and the greedy output stays that of an uncontended run."""
    path, _ = gemma2
    prompts = [list(range(30, 50)), list(range(60, 80)), [5, 17, 42]]
    tight = dict(num_blocks=24, preemption_mode=mode, enable_prefix_caching=False, reserve_new_tokens=False)
    hybrid, llm = _generate(path, prompts, **tight)
    assert llm.engine.scheduler.num_preemptions > 0
    roomy, _ = _generate(path, prompts, disable_hybrid_kv_cache_manager=True)
    assert hybrid == roomy


def test_sliding_group_holds_only_its_window_while_decoding(gemma2):
    path, _ = gemma2
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_model_len=128)
    engine = llm.engine
    engine.add_request("r", list(range(30, 70)), SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                 ignore_eos=True))
    seq = engine.requests["r"].seqs[0]
    for _ in range(10):
        engine.step()
    full, sliding = seq.block_table, seq.block_table.group_tables[0]
    assert seq.num_computed_tokens == 49  # the prompt in one step, then 9 decodes
    assert len(full.ids) == len(sliding.ids) == 13
    # Given back at the last block boundary (48): blocks wholly before 48 - 8 + 1 = 41, i.e.
    # entries 0..9; live: 10, 11, 12 (at most window_blocks(8, 4) = 4).
    assert sliding.num_freed == 10
    assert len(sliding.live_ids()) == 3
    assert sliding.ids[:sliding.num_freed] == [0] * sliding.num_freed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - len(full.ids) - len(
        sliding.live_ids())


@pytest.mark.gpu
def test_gpu_cuda_graphs_hybrid_equals_one_table(tmp_path):
    """Decode CUDA graphs and piecewise graphs with per-group static buffers: greedy equal."""
    path, _ = make_tiny_model(tmp_path, "gemma2", initializer_range=0.3, tied=True)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = PROMPTS + [[(200 + i) % 256 for i in range(200)]]  # a long prompt inside the tiny vocabulary
    outs = {}
    for off in (False, True):
        llm = LLM(model=path, dtype="float32", block_size=16, max_model_len=512,
                  disable_hybrid_kv_cache_manager=off)
        assert llm.engine.runner.graphs is not None
        assert llm.engine.runner.kv_layout.hybrid != off
        outs[off] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[False] == outs[True]
