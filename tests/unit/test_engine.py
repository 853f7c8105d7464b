"""Engine behaviour end to end on the CPU: batching, preemption, prefix cache, n > 1, bad input."""

import pytest

from rooflm import LLM, SamplingParams
from rooflm.engine.llm_engine import LLMEngine
from rooflm.model.loader import ModelLoadError
from tests.models.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.3)
    return path


def prompts_of(lengths, offset=0):
    return [[(7 * i + 3 * j + offset) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_tiny_pool_preempts_and_matches_ample_pool(tiny_path):
    lengths = [37, 21, 50, 9, 44, 30, 17, 26, 33, 12, 48, 25, 40, 15, 29, 36]
    prompts = prompts_of(lengths)
    ample = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4, num_blocks=512)
    ref = tokens(ample.generate(prompts, GREEDY))
    need = sum(-(-(n + GREEDY.max_tokens) // 4) for n in lengths)
    small_pool = need // 10
    assert small_pool >= -(-(max(lengths) + GREEDY.max_tokens) // 4)  # one request still fits
    for mode in ("recompute", "swap"):
        # Without admission's growth reservation, which exists to avoid these preemptions.
        small = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4, num_blocks=small_pool,
                    preemption_mode=mode, reserve_new_tokens=False)
        assert tokens(small.generate(prompts, GREEDY)) == ref
        engine = small.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == small_pool


def test_chunked_prefill_and_budget_give_same_tokens(tiny_path):
    prompts = prompts_of([37, 21, 50])
    ref = tokens(LLM(model=tiny_path, device="cpu", dtype="float32").generate(prompts, GREEDY))
    chunked = LLM(model=tiny_path, device="cpu", dtype="float32", max_num_batched_tokens=7, max_num_seqs=2)
    assert tokens(chunked.generate(prompts, GREEDY)) == ref


def test_prefix_cache_hit_gives_same_tokens(tiny_path):
    llm = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4)
    prompt = prompts_of([40])[0]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 36  # whole blocks, the last token recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # A different salt is another tenant: no hit.
    eng = llm.engine
    eng.add_request("salted", prompt, GREEDY, cache_salt="tenant-b")
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[0].num_cached_tokens == 0


def test_n_samples_share_prompt_blocks(tiny_path):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32", block_size=4)
    prompt = prompts_of([10])[0]  # 2 full blocks + 2 tokens in a shared partial block
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6))
    engine.step()  # prefill, sample 3 first tokens, fork
    req = engine.requests["r"]
    assert len(req.seqs) == 3
    tables = [s.block_table.ids for s in req.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert [engine.block_manager.blocks[b].ref_cnt for b in tables[0]] == [3, 3, 3]
    engine.step()  # each sample writes its second token: the partial block is copied on write
    tables = [s.block_table.ids for s in req.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert [engine.block_manager.blocks[b].ref_cnt for b in tables[0][:2]] == [3, 3]
    while engine.has_unfinished_requests():
        final = engine.step()
    assert len(final[0].outputs) == 3 and all(len(o.token_ids) == 6 for o in final[0].outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_reproducible_and_batch_independent(tiny_path):
    llm = LLM(model=tiny_path, device="cpu", dtype="float32")
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = prompts_of([12])[0]
    alone = tokens(llm.generate([prompt], p))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=16)] * 5
    batch = llm.generate([prompt] + prompts_of([5, 9, 30, 3, 8], 11), [p] + others)
    assert tokens(batch)[0] == alone
    assert tokens(llm.generate([prompt], p))[0] == alone
    different = SamplingParams(temperature=0.9, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert tokens(llm.generate([prompt], different))[0] != alone


def test_abort_frees_blocks(tiny_path):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32", block_size=4)
    engine.add_request("a", prompts_of([30])[0], GREEDY)
    engine.add_request("b", prompts_of([20])[0], GREEDY)
    engine.step()
    out = engine.abort_request("a")
    assert out[0].finished and out[0].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_length_and_min_tokens(tiny_path):
    llm = LLM(model=tiny_path, device="cpu", dtype="float32")
    out = llm.generate([prompts_of([5])[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    # Greedy token 0 first is forbidden while under min_tokens when it is a stop token.
    first = out.outputs[0].token_ids[0]
    p = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[first], min_tokens=1)
    out = llm.generate([prompts_of([5])[0]], p)[0]
    assert out.outputs[0].token_ids[0] != first


@pytest.mark.parametrize("prompt,params,match", [
    ("", None, "prompt is empty"),
    ([], None, "prompt is empty"),
    ([1, 2, 300], None, r"index 2 is 300; token ids must be integers in \[0, 256\)"),
    ([1, -1], None, "index 1 is -1"),
    ([1, 2.5], None, "index 1 is 2.5"),
    (list(range(1, 250)) * 3, None, "prompt has 747 tokens, but the context length is 512"),
    ([1, 2, 3], SamplingParams(max_tokens=510), "over the context length of 512"),
    ([1, 2, 3], SamplingParams(stop_token_ids=[999]), "stop_token_ids contains 999"),
])
def test_bad_requests_rejected_and_engine_keeps_serving(tiny_path, prompt, params, match):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32")
    engine.add_request("good", [5, 6, 7], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.requests
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].request_id == "good" and len(outs[0].outputs[0].token_ids) == 24


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
])
def test_sampling_params_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_text_prompt_without_tokenizer_is_a_clear_error(tiny_path):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("x", "hello", GREEDY)


def test_bad_model_files_raise_load_errors(tmp_path, tiny_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(tiny_path, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(model=str(broken), device="cpu")
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        LLM(model=str(bad_gguf), device="cpu")
    with pytest.raises(ModelLoadError):
        LLM(model=str(tmp_path / "missing"), device="cpu")


def test_final_output_kind_returns_only_the_finished_output(tiny_path):
    engine = LLMEngine.from_kwargs(model=tiny_path, device="cpu", dtype="float32")
    final = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind="final")
    delta = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("final", prompts_of([12])[0], final)
    engine.add_request("delta", prompts_of([12])[0], delta)
    seen = {"final": [], "delta": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert len(seen["delta"]) == 6 and seen["delta"][-1].finished
    assert seen["final"][0].outputs[0].token_ids == seen["delta"][-1].outputs[0].token_ids
    assert engine.snapshot().generation_tokens == 12  # counted whether or not an output was made


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="cumulative")
