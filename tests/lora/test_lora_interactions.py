"""LoRA beside the engine's other features (issue 49's "Interaction"): speculative decoding (the
verify forward runs under each request's adapter; drafts come from the base), structured outputs,
quantized base weights (the hook adds to the quantized linear's output), tensor parallelism
(adapters sharded like their base linears), and the combination still refused at start-up,
naming its flags."""

import pytest
import torch

from rooflm.llm import LLM
from rooflm.lora.adapter import load_adapter
from rooflm.lora.request import LoRARequest
from rooflm.sampling_params import SamplingParams, StructuredOutputsParams
from rooflm.spec.replay import ReplayProposer
from tests.lora.adapters import make_peft_adapter
from tests.models.tiny_models import make_tiny_model_with_tokenizer

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
BASE = dict(dtype="float32", device="cpu", block_size=4, num_blocks=256, enable_lora=True, max_loras=2,
            max_lora_rank=8)
# One prompt per (prompt, adapter) pair: the replay proposer drafts by prompt.
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 44)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101],
           [60, 61, 62, 63, 64], [200, 201, 17, 42], [77, 78, 79, 80, 81, 82]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_interactions")
    base_path = make_tiny_model_with_tokenizer(root)
    a1, _ = make_peft_adapter(base_path, root / "a1", rank=8, alpha=16, seed=1)
    a2, _ = make_peft_adapter(base_path, root / "a2", rank=4, alpha=8, rslora=True,
                              targets=("q_proj", "v_proj", "down_proj"), seed=2)
    loras = [LoRARequest("one", 1, a1), LoRARequest("two", 2, a2), None] * 2
    return dict(base_path=base_path, loras=loras)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(model=tiny["base_path"], **BASE)
    return _tokens(llm.generate(PROMPTS, GREEDY, lora_request=tiny["loras"]))


def test_the_adapters_change_these_prompts(tiny, reference):
    """Else the comparisons below could not tell an adapter from the base model."""
    llm = LLM(model=tiny["base_path"], **BASE)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) != reference


# ---- speculative decoding ----------------------------------------------------------------------


@pytest.mark.parametrize("corrupt", [0.0, 0.3])
def test_speculative_verify_runs_under_each_requests_adapter(tiny, reference, corrupt):
    """Drafts of each request's own (adapter's) continuation, some corrupted: the verify forward
    must run under the adapter for the right drafts to stand and the wrong ones to fall, and the
    tokens are plain decoding's."""
    llm = LLM(model=tiny["base_path"], speculative_method="ngram", speculative_max_batch_tokens=512,
              speculative_policy="budget", **BASE)
    continuations = {tuple(p): out for p, out in zip(PROMPTS, reference)}
    llm.engine.spec.set_proposer(ReplayProposer(continuations, corrupt, 256, seed=3))
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=tiny["loras"])) == reference
    stats = llm.engine.spec.stats.snapshot()
    assert stats.num_accepted_tokens > 0, "no draft was accepted: the verify path was not exercised"
    if corrupt == 0.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens, "the adapter's own drafts all stand"


def test_a_draft_model_proposes_without_adapters(tiny, reference):
    llm = LLM(model=tiny["base_path"], speculative_method="draft", draft_model=tiny["base_path"],
              speculative_max_batch_tokens=512, speculative_policy="budget", **BASE)
    assert llm.engine.spec.proposer.runner.lora is None, "the draft runner carries no adapter hooks"
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=tiny["loras"])) == reference


# ---- structured outputs ------------------------------------------------------------------------


def test_structured_outputs_hold_under_an_adapter(tiny):
    llm = LLM(model=tiny["base_path"], **BASE)
    choices = ["w9", "w10w11", "w12w13w14"]
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices))
    loras = tiny["loras"][:3]
    mixed = llm.generate(PROMPTS[:3], params, lora_request=loras)
    # The word-level tokenizer's text joins tokens with spaces: the choices by their token ids.
    allowed = [[9], [10, 11], [12, 13, 14]]
    for out, prompt, lora in zip(mixed, PROMPTS[:3], loras):
        ids = [t for t in out.outputs[0].token_ids if t != 2]  # </s> ends a finished choice
        assert ids in allowed, out.outputs[0]
        alone = llm.generate([prompt], params, lora_request=lora)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


# ---- quantized base weights --------------------------------------------------------------------


def test_hook_adds_the_adapter_to_a_quantized_linear(tiny):
    # FP8 runs quantized on every device (fp32 emulation on the CPU); int8/int4 have no CPU
    # kernel and are dequantized at load there, so they would prove nothing here.
    llm = LLM(model=tiny["base_path"], quantization="fp8", **BASE)
    runner = llm.engine.runner
    lora = tiny["loras"][0]
    slot = runner.lora.activate([lora])[lora]
    adapter = load_adapter("one", lora.lora_path, runner.model_config, max_rank=8)
    qkv = runner.model.model.layers[1].self_attn.qkv_proj
    assert qkv.quant is not None, "the base weight is FP8"
    x = torch.randn(5, qkv.in_features)
    runner.lora_mapping.set_step([slot, -1, slot, slot, -1], decode_only=False)
    with torch.inference_mode():
        y = qkv(x)
        runner.lora_mapping.clear()
        base = qkv(x)
    expected = base.clone()
    rows = torch.tensor([0, 2, 3])
    for shard, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        a, b = adapter.weights[(1, proj)]
        offset, size = qkv.shard_offsets[shard]
        expected[rows, offset:offset + size] += (x[rows] @ a.float().T) @ b.float().T * adapter.scaling
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization", ["fp8", "int4-g32"])
def test_quantized_base_serves_adapters_and_keeps_its_own_tokens(tiny, quantization):
    llm = LLM(model=tiny["base_path"], quantization=quantization, **BASE)
    mixed = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=tiny["loras"]))
    alone = _tokens(llm.generate(PROMPTS, GREEDY))
    for got, base, lora in zip(mixed, alone, tiny["loras"]):
        if lora is None:
            assert got == base, "the base model's rows beside adapters are the quantized base's"
    assert [g for g, lora in zip(mixed, tiny["loras"]) if lora] != [b for b, lora in zip(alone, tiny["loras"]) if lora]


# ---- tensor parallelism (gloo, 2 ranks on the CPU) --------------------------------------------


def test_tensor_parallel_shards_adapters_like_their_linears(tiny, reference):
    """qkv and gate_up column-parallel (B's rows split), o and down row-parallel (A's columns
    split, the partial deltas summed by the linear's all-reduce); rank 1 mirrors rank 0's slot
    writes from the step packet. Two adapters and the base in one batch give TP=1's tokens."""
    llm = LLM(model=tiny["base_path"], tensor_parallel_size=2, **BASE)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=tiny["loras"])) == reference
    finally:
        llm.shutdown()


# ---- what is still refused, by name ------------------------------------------------------------


def test_sleep_mode_with_lora_is_refused(tiny):
    with pytest.raises(ValueError, match=r"--enable-lora does not run with --enable-sleep-mode"):
        LLM(model=tiny["base_path"], enable_sleep_mode=True, **BASE)
