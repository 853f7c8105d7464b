"""Async scheduling (step t+1 queued before step t's tokens are read back) must give exactly
what the synchronous engine gives. The logic is device-independent, so it is tested on the CPU."""

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


def run_both(path, prompts, params, **kw):
    results = []
    for mode in (False, True):
        llm = LLM(model=path, device="cpu", dtype="float32", async_scheduling=mode, **kw)
        assert llm.engine.async_scheduling is mode
        outs = llm.generate(prompts, params)
        results.append([[(o.token_ids, o.finish_reason, o.stop_reason) for o in r.outputs] for r in outs])
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return results


PROMPTS = prompts_of([37, 21, 50, 9, 44, 30, 17, 26])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=12, n=3),
    SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=9, min_tokens=5, logprobs=2),
], ids=["greedy", "seeded", "n3", "penalties", "min-tokens-logprobs"])
def test_async_equals_sync(tiny_path, params):
    sync, async_ = run_both(tiny_path, PROMPTS, params)
    assert async_ == sync


def test_seeded_samples_that_end_at_different_steps(tiny_path):
    # A stop set of a third of the vocabulary ends the n samples at different steps. Under
    # async scheduling the step after a sample's last one is already queued and still
    # samples it (the host has not read the stop token yet): that draw must come from the
    # finished sample's own generator, not from one its siblings go on drawing from.
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=20, n=4,
                            stop_token_ids=list(range(0, 256, 3)))
    sync, async_ = run_both(tiny_path, PROMPTS[:4], params)
    lengths = {len(tokens) for request in sync for tokens, _, _ in request}
    assert len(lengths) > 2  # the samples did end at different steps
    assert async_ == sync


def test_seeded_samples_of_one_request_differ(tiny_path):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=8, n=3, ignore_eos=True)
    [outs] = LLM(model=tiny_path, device="cpu", dtype="float32").generate([PROMPTS[0]], params)
    samples = [o.token_ids for o in outs.outputs]
    assert len({tuple(s) for s in samples}) == 3
    # Sample i of n is the one sample of the same request seeded with seed + i (as vLLM seeds
    # its child requests), so a seeded request's samples are reproducible one by one.
    one = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    [alone] = LLM(model=tiny_path, device="cpu", dtype="float32").generate([PROMPTS[0]], one)
    assert alone.outputs[0].token_ids == samples[1]


def test_async_equals_sync_with_preemption_and_chunking(tiny_path):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for mode in ("recompute", "swap"):
        sync, async_ = run_both(tiny_path, PROMPTS, params, block_size=4, num_blocks=30,
                                max_num_batched_tokens=16, preemption_mode=mode,
                                reserve_new_tokens=False)  # so that the small pool preempts
        assert async_ == sync


def test_stop_token_finishes_at_the_same_place(tiny_path):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sync, _ = run_both(tiny_path, PROMPTS[:2], greedy)
    stop_at = sync[0][0][0][7]  # the 8th token of the first prompt's greedy output
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at])
    sync, async_ = run_both(tiny_path, PROMPTS[:2], params)
    assert async_ == sync
    assert sync[0][0][1] == "stop" and sync[0][0][0][-1] == stop_at


def test_abort_while_a_step_is_in_flight(tiny_path):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32", async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request("a")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    assert set(final) == {"b"} and len(final["b"].outputs[0].token_ids) == 30
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_output_reaching_the_context_length_is_whole(tiny_path):
    # prompt + max_tokens == max_model_len: the last token must not be cut by the in-flight one.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sync, async_ = run_both(tiny_path, prompts_of([24, 24]), params, max_model_len=64)
    assert async_ == sync
    assert [len(r[0][0]) for r in async_] == [40, 40]


class _Event:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_samples_nothing_is_waited_for_only_under_async(tiny_path, async_scheduling):
    """A prefill chunk that does not end its prompt samples nothing, so its collect has no tokens
    to wait for; under async scheduling the engine waits on the step's event all the same (the
    next step is already queued), so that the time it reports is the step's own. On the CPU there
    is no event: a stand-in counts the waits."""
    llm = LLM(model=tiny_path, device="cpu", dtype="float32", async_scheduling=async_scheduling,
              max_num_batched_tokens=16, enable_chunked_prefill=True)
    runner = llm.engine.runner
    launch, events = runner.launch, []

    def launch_with_event(*args, **kwargs):
        handle = launch(*args, **kwargs)
        if handle.sampled is None:
            handle.ready = _Event()
            events.append(handle.ready)
        return handle

    runner.launch = launch_with_event
    llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))  # 50 tokens
    assert len(events) >= 3  # chunks of 16 that end no prompt
    assert [e.waits for e in events] == [1 if async_scheduling else 0] * len(events)
