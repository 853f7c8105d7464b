"""The engine with an FP8 KV cache (--kv-cache-dtype fp8) on the CPU: scales travel with their
blocks through swaps, recompute and prefix hits; outputs stay close to the full-precision cache."""

import pytest
import torch

from rooflm import LLM, SamplingParams
from tests.models.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny-fp8"), "llama", initializer_range=0.3)
    return path


def prompts_of(lengths):
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def fp8_llm(path, **kwargs):
    return LLM(model=path, device="cpu", dtype="float32", block_size=4, kv_cache_dtype="fp8", **kwargs)


def test_fp8_pool_layout_and_bytes(tiny_path):
    llm = fp8_llm(tiny_path, num_blocks=64)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_scales.shape == runner.kv_cache.shape[:-1] and runner.kv_scales.dtype == torch.float32
    head_dim = llm.engine.model_config.head_dim
    # One byte per element plus a 4-byte scale per head vector, against fp32's 4 bytes.
    assert llm.engine.info.kv_dtype_bytes == pytest.approx(1 + 4 / head_dim)
    full = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4, num_blocks=64).engine.runner
    assert runner.kv_bytes_per_block() / full.kv_bytes_per_block() == pytest.approx((1 + 4 / head_dim) / 4)
    assert llm.engine.info.kv_cache_dtype == "fp8"


def test_fp8_preemption_by_swap_and_recompute_matches_ample_pool(tiny_path):
    lengths = [37, 21, 50, 9, 44, 30, 17, 26, 33, 12]
    prompts = prompts_of(lengths)
    ref = tokens(fp8_llm(tiny_path, num_blocks=512).generate(prompts, GREEDY))
    need = sum(-(-(n + GREEDY.max_tokens) // 4) for n in lengths)
    for mode in ("swap", "recompute"):
        small = fp8_llm(tiny_path, num_blocks=need // 6, preemption_mode=mode, reserve_new_tokens=False)
        assert tokens(small.generate(prompts, GREEDY)) == ref, mode
        assert small.engine.scheduler.num_preemptions > 0


def test_fp8_prefix_hit_gives_same_tokens(tiny_path):
    llm = fp8_llm(tiny_path)
    prompt = prompts_of([40])[0]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 36
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_fp8_outputs_stay_close_to_the_full_precision_cache(tiny_path):
    prompts = prompts_of([37, 21, 50, 9, 44, 30, 17, 26])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    full = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4).generate(prompts, params)
    fp8 = fp8_llm(tiny_path).generate(prompts, params)
    first_tokens = [a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(full, fp8)]
    assert sum(first_tokens) >= 7  # the first token sees the prompt's K/V only through the cache
    # The chosen token's logprob under each cache, where both chose the same one.
    diffs = []
    for a, b in zip(full, fp8):
        for tok_a, tok_b, lp_a, lp_b in zip(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                            a.outputs[0].logprobs, b.outputs[0].logprobs):
            if tok_a != tok_b:
                break
            diffs.append(abs(lp_a[tok_a].logprob - lp_b[tok_b].logprob))
    # This random model's attention is peaky (initializer 0.3), so E4M3's 3 mantissa bits move
    # its logprobs by ~0.14 on average; a misapplied scale moves them by whole units. (SmolLM2's
    # real weights, 4 prompts x 24 tokens: 0.037 mean, 0.15 max.)
    mean = sum(diffs) / len(diffs)
    assert len(diffs) >= 32 and mean < 0.3, (len(diffs), mean, max(diffs))


def test_bad_kv_cache_dtype_names_the_choices(tiny_path):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3"):
        LLM(model=tiny_path, device="cpu", kv_cache_dtype="int4")
