"""The real default model through the engine: batching, stop strings, streaming text."""

import pytest

from rooflm import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time,", "List three fruits:",
           "def add(a, b):", "The meaning of life is", "Water boils at",
           "In 1969, the first man on the moon", "My favourite colour is"]


def test_batch_independence_fp32(smollm2_exact):
    # The float32 path. The default CPU path (int4 weights, bf16 activations) is not batch
    # invariant: torch's int4 kernel sums a 1-row and an 8-row matmul differently, and greedy
    # tokens of this prompt part at the 8th token (seen on 2026-11-23).
    smollm2 = smollm2_exact
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    target = "Tell me a short story about a robot who learns to paint."
    alone = smollm2.generate([target], params)[0].outputs[0].token_ids
    batch = smollm2.generate(PROMPTS[:4] + [target] + PROMPTS[4:7], params)
    assert batch[4].outputs[0].token_ids == alone


def test_stop_string_trimmed_across_tokens(smollm2):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = smollm2.generate(["Once upon a time,"], params)[0].outputs[0].text
    # A stop string that starts mid-token and spans a token boundary.
    stop = full[8:15]
    out = smollm2.generate(["Once upon a time,"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    kept = smollm2.generate(["Once upon a time,"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[:full.index(stop) + len(stop)]


def test_streamed_deltas_equal_final_text_on_multibyte_output(smollm2):
    engine = smollm2.engine
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write 你好世界 and 🙂🎉 ten times."}])
    engine.add_request("mb", tok.encode(prompt, add_special_tokens=False),
                       SamplingParams(temperature=0.8, seed=7, max_tokens=40))
    streamed = ""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.delta_text[0]
            assert "\ufffd" not in out.delta_text[0] or "\ufffd" in tok.decode(out.outputs[0].token_ids)
            final = out
    assert streamed == final.outputs[0].text == tok.decode(final.outputs[0].token_ids)


def test_prompt_logprobs_and_top_logprobs(smollm2):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=2)
    out = smollm2.generate(["The capital of France is"], params)[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in entry and len(entry) <= 3
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert entry[tok].rank == 1 and len(entry) == 5  # greedy token is the top one
        ranked = sorted(entry.values(), key=lambda e: e.rank)
        assert [e.logprob for e in ranked] == sorted([e.logprob for e in ranked], reverse=True)


def test_weight_bytes_come_from_the_stored_tensors(smollm2, smollm2_exact):
    # The file's own block bytes per weight, for the layers' linear weights and for the tied
    # LM head: what a decode step streams, so what MBU must count on the quantized path.
    from gguf import GGUFReader

    from rooflm.model.loader import default_model_path
    from rooflm.perf.live import StepMeter

    tensors = {t.name: t for t in GGUFReader(default_model_path()).tensors}
    parts = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.")
    layers = [t for name, t in tensors.items() if name.startswith("blk.")
              and any(part in name for part in parts)]
    layer_bytes = sum(int(t.n_bytes) for t in layers) / sum(int(t.n_elements) for t in layers)
    head = tensors["token_embd.weight"]
    head_bytes = int(head.n_bytes) / int(head.n_elements)
    assert layer_bytes == pytest.approx(20 / 32)  # Q4_1: 32 codes of 4 bits, fp16 d and m
    assert head_bytes == pytest.approx(34 / 32)  # Q8_0: 32 codes of 8 bits, fp16 d
    quant, exact = smollm2.engine.info, smollm2_exact.engine.info
    assert quant.weight_dtype_bytes == pytest.approx(layer_bytes, rel=1e-3)
    assert quant.head_dtype_bytes == pytest.approx(head_bytes, rel=1e-3)
    assert exact.weight_dtype_bytes == exact.head_dtype_bytes == 4.0
    assert quant.act_dtype_bytes == exact.act_dtype_bytes == 4.0
    # A decode step's bytes: the quantized weights, not float32 ones.
    cfg = quant.model_config
    shape = dict(num_decode_seqs=1, decode_context_tokens=64)
    quant_bytes = StepMeter.for_engine(quant)._step_cost(**shape).bytes
    exact_bytes = StepMeter.for_engine(exact)._step_cost(**shape).bytes
    layer_weights = cfg.num_hidden_layers * (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)
                                             + cfg.q_size * cfg.hidden_size
                                             + 3 * cfg.hidden_size * cfg.intermediate_size)
    saved = layer_weights * (4 - layer_bytes) + cfg.vocab_size * cfg.hidden_size * (4 - head_bytes)
    assert exact_bytes - quant_bytes == pytest.approx(saved, rel=1e-3)
