"""Output processing end to end on the CPU: forks, swaps and aborts around the block tables
that the processor changes only through the scheduler."""

import pytest

from rooflm import LLM, SamplingParams
from rooflm.engine.llm_engine import LLMEngine
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.3)
    return path


def prompts_of(lengths, offset=0):
    return [[(7 * i + 3 * j + offset) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def samples(outputs):
    return [[o.token_ids for o in r.outputs] for r in outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_forked_samples_under_preemption_match_an_ample_pool(tiny_path, async_scheduling):
    # Prompts of 4k + 2 tokens: the samples share a half-full block, copied on write, also
    # after a swap-in. Swapped-out samples keep sharing host blocks.
    prompts = prompts_of([18, 10, 22, 14, 26, 6])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    ample = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4, num_blocks=512)
    ref = samples(ample.generate(prompts, params))
    for mode in ("recompute", "swap"):
        small = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4, num_blocks=24,
                    preemption_mode=mode, async_scheduling=async_scheduling,
                    reserve_new_tokens=False)  # admission's reservation would avoid the preemptions
        assert samples(small.generate(prompts, params)) == ref
        bm = small.engine.block_manager
        assert small.engine.scheduler.num_preemptions > 0
        assert bm.num_free_blocks == bm.num_blocks
        assert len(bm.free_host_blocks) == bm.num_host_blocks and not any(bm.host_ref_cnt)


def test_generation_tokens_are_counted_once_per_sample(tiny_path):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32")
    engine.add_request("a", prompts_of([9])[0], SamplingParams(temperature=0, max_tokens=5, n=3))
    engine.add_request("b", prompts_of([7], 1)[0], SamplingParams(temperature=0, max_tokens=4))
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += sum(len(ids) for ids in out.delta_token_ids)
    assert produced == 3 * 5 + 4
    assert engine.snapshot().generation_tokens == produced


def test_a_token_in_flight_for_an_aborted_request_is_dropped(tiny_path):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32", async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", prompts_of([9])[0], params)
    assert engine.step() == []  # launched, not yet processed
    engine.abort_request("r")
    engine.add_request("r", prompts_of([5], 3)[0], params)  # the id is free again
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
