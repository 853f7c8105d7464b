"""Expert parallelism on the CPU (gloo): --enable-expert-parallel with TP=2 gives the tokens and
log-probabilities of TP=2 without it, on tiny random MoE models (Qwen3-MoE; Qwen2-MoE with its
tensor-parallel shared expert), fp32. Each rank then holds half the experts whole."""

from __future__ import annotations

import pytest

from rooflm import LLM
from rooflm.sampling_params import SamplingParams
from tests.models.test_moe_parity import make_tiny_moe

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 52)), [11]]


def _run(path, **options):
    """Greedy outputs, and rank 0's (experts held, intermediate width) of its first MoE block."""
    llm = LLM(model=path, tensor_parallel_size=2, dtype="float32", device="cpu", block_size=4, **options)
    try:
        experts = next(m for m in llm.engine.runner.model.modules() if type(m).__name__ == "Experts")
        held = (experts.w13.shape[0], experts.w2.shape[-1])
        return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)), held
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_expert_parallel_gives_the_tokens_of_tensor_parallel(tmp_path, family):
    path, _ = make_tiny_moe(tmp_path, family)
    tp, tp_held = _run(path)
    ep, ep_held = _run(path, enable_expert_parallel=True)
    experts, inter = tp_held
    assert ep_held == (experts // 2, 2 * inter)  # half the experts, each whole
    assert [o.outputs[0].token_ids for o in ep] == [o.outputs[0].token_ids for o in tp]
    for a, b in zip(tp, ep):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_b[token].logprob == pytest.approx(lp_a[token].logprob, abs=1e-4)


def test_expert_parallel_refuses_experts_that_do_not_split(tmp_path):
    path, _ = make_tiny_moe(tmp_path, "qwen3_moe", num_experts=5)
    with pytest.raises(Exception, match="5 experts do not split evenly over 2 ranks"):
        _run(path, enable_expert_parallel=True)


@pytest.mark.gpu
def test_expert_parallel_on_two_gpus_gives_the_tokens_of_tensor_parallel(tmp_path):
    """The fused kernel's local_only path over NCCL: EP=2 equals TP=2, fp32."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path, _ = make_tiny_moe(tmp_path, "qwen3_moe")

    def run(**options):
        llm = LLM(model=path, tensor_parallel_size=2, dtype="float32", device="cuda", block_size=16, **options)
        try:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            return [o.outputs[0].token_ids for o in outs]
        finally:
            llm.shutdown()

    assert run(enable_expert_parallel=True) == run()
