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


@pytest.fixture(scope="module")
def tiny_with_text(tmp_path_factory):
    """The tiny model with a byte-level tokenizer of its 256 ids: every id is one byte, so
    sampled ids are mostly broken UTF-8, the detokenizer's hardest case."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny_text"), "llama", initializer_range=0.3)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path


def test_final_outputs_detokenized_at_the_end_equal_step_by_step_text(tiny_with_text):
    # output_kind "final" without stop strings defers detokenization to the end (or the abort):
    # the text, and the last step's delta, must be those of a request detokenized every step.
    engine = LLMEngine.from_kwargs(model=tiny_with_text, device="cpu", dtype="float32")
    prompts = prompts_of([9, 14, 5])
    outputs = {}
    for kind in ("delta", "final"):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=12 + 5 * i, ignore_eos=True,
                                    output_kind=kind)
            engine.add_request(f"{kind}{i}", prompt, params)
    engine.add_request("abort-delta", prompts[0], SamplingParams(temperature=1.0, seed=7, max_tokens=40))
    engine.add_request("abort-final", prompts[0], SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                                                                 output_kind="final"))
    for _ in range(6):
        for out in engine.step():
            outputs[out.request_id] = out
    aborted = {o.request_id: o for o in engine.abort_request(["abort-delta", "abort-final"])}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    texts = set()
    for i in range(len(prompts)):
        a, b = outputs[f"delta{i}"], outputs[f"final{i}"]
        assert a.finished and b.finished
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        assert b.delta_text == a.delta_text
        texts.add(a.outputs[0].text)
    assert len(texts) == len(prompts) and all(texts)
    a, b = aborted["abort-delta"], aborted["abort-final"]
    assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(a.outputs[0].token_ids) == 6
    assert b.outputs[0].text == a.outputs[0].text
