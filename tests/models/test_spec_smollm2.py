"""Speculative decoding on the real default model (SmolLM2-135M, weights dequantized to fp32):
greedy text identical to plain decoding, with stop strings, on copy-heavy and open prompts."""

import pytest

from rooflm import LLM, SamplingParams
from rooflm.sampling_params import StructuredOutputsParams

TEXT = ("The quick brown fox jumps over the lazy dog. The dog, being lazy, does not move. "
        "The fox jumps again, and again the dog does not move.")
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat this text exactly:\n{TEXT}"}],
    [{"role": "user", "content": "def area(width, height):\n    return width * height\n\n"
                                 "Write a function perimeter(width, height) in the same style."}],
]


@pytest.fixture(scope="module")
def spec_llm():
    # The budget policy: these tests check the mechanism; when speculating pays is test_spec_policy.py's.
    return LLM(dtype="float32", device="cpu", quantization="none", speculative_method="ngram",
               speculative_max_batch_tokens=64, speculative_policy="budget")


def test_greedy_text_is_identical_with_ngram_speculation(smollm2_exact, spec_llm):
    params = SamplingParams(temperature=0, max_tokens=32)
    ref = smollm2_exact.chat(CONVERSATIONS, params)
    out = spec_llm.chat(CONVERSATIONS, params)
    assert [o.outputs[0].text for o in out] == [r.outputs[0].text for r in ref]
    stats = spec_llm.engine.snapshot().spec
    assert stats.num_accepted_tokens > 0  # the copy prompt gives the proposer plenty to find
    # A stop string taken from the middle of the copied text ends both runs at the same place.
    words = ref[0].outputs[0].text.split()
    stop = SamplingParams(temperature=0, max_tokens=32, stop=[" ".join(words[6:8])])
    ref_stop = smollm2_exact.chat(CONVERSATIONS[:1], stop)[0].outputs[0]
    out_stop = spec_llm.chat(CONVERSATIONS[:1], stop)[0].outputs[0]
    assert ref_stop.finish_reason == "stop"
    assert (out_stop.text, out_stop.finish_reason) == (ref_stop.text, ref_stop.finish_reason)
    assert out_stop.token_ids == ref_stop.token_ids


def test_constrained_and_speculating_requests_share_a_step(smollm2_exact, spec_llm):
    """A grammar-constrained request does not speculate; the one beside it does, unchanged."""
    params = SamplingParams(temperature=0, max_tokens=24)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    tok = spec_llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False)
               for c in CONVERSATIONS[:1] + [[{"role": "user", "content": "Is water wet?"}]]]
    ref = smollm2_exact.generate(prompts[:1], params)[0].outputs[0]
    before = spec_llm.engine.snapshot().spec.num_accepted_tokens
    copy, answer = spec_llm.generate(prompts, [params, choice])
    assert copy.outputs[0].token_ids == ref.token_ids
    assert answer.outputs[0].text in ("yes", "no")
    assert spec_llm.engine.snapshot().spec.num_accepted_tokens > before
