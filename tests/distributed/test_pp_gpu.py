"""Pipeline parallelism on 2 GPUs (NCCL point-to-point): PP=2 gives the greedy tokens PP=1 gives,
fp32, on a small random model, through the ways a step runs on CUDA with PP (eager: no graphs
under PP yet): the batch-1 GEMV layers (stage 0 sends its whole residual stream with a zero
residual), batched decode and prefill, async scheduling (pending ids filled on stage 0 from the
previous step's samples, behind NCCL receives on the same stream), prompt logprobs (their rows
come back from the last stage), each with one step at a time through the stages and with two
batches in flight (stage 0's layers of batch B queued before batch A's rows come back).

The PP=1 side runs with --enforce-eager so that both sides take the same kernels; fp32 on CUDA
multiplies in TF32, so tokens are compared as in test_tp_gpu: a divergence must be a near tie
in both runs, after the first 8 tokens. The shutdown must finish in SHUTDOWN_LIMIT_S.
Run: pytest -m gpu tests/distributed/test_pp_gpu.py (benchmarks/pp.sh runs it first)."""

from __future__ import annotations

import time

import pytest
import torch

from rooflm import LLM
from rooflm.sampling_params import SamplingParams
from tests.distributed.test_tp_gpu import SMALL, _check_close
from tests.models.tiny_models import make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

SHUTDOWN_LIMIT_S = 30.0


def _outputs(path, pp: int, prompts, max_tokens: int, micro_batches=None):
    llm = LLM(model=str(path), pipeline_parallel_size=pp, dtype="float32", max_model_len=512,
              max_num_seqs=16, enforce_eager=True, pipeline_micro_batches=micro_batches)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
        batch = [o.outputs[0] for o in llm.generate(prompts, params)]
        single = llm.generate([prompts[0]], params)[0].outputs[0]  # batch 1: the GEMV path
        scored = llm.generate([prompts[1]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
        if pp > 1:
            assert llm.engine.runner.stage is not None and llm.engine.runner.kv_cache.shape[0] == 2
        return batch + [single], scored.prompt_logprobs
    finally:
        started = time.monotonic()
        llm.shutdown()
        took = time.monotonic() - started
        print(f"pp={pp} micro-batches {micro_batches}: shutdown took {took:.1f} s")
        assert took < SHUTDOWN_LIMIT_S


@pytest.mark.parametrize("family,attention", [("llama", "gqa"), ("qwen2", "mqa")])
def test_pp2_equals_pp1_on_two_gpus(tmp_path, family, attention):
    path, _ = make_tiny_model(tmp_path, family, attention=attention, **SMALL)  # 4 layers: 2 a stage
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 40, 120)]
    one, one_scored = _outputs(path, 1, prompts, 24)
    for micro_batches in (1, None):  # one step at a time through the stages; two batches in flight
        two, two_scored = _outputs(path, 2, prompts, 24, micro_batches)
        _check_close(one, two)
        exact = sum(a.token_ids == b.token_ids for a, b in zip(one, two))
        print(f"{family} micro-batches {micro_batches}: {exact} of {len(one)} sequences token-for-token equal")
        assert len(two_scored) == len(one_scored) == len(prompts[1])
        for a, b in zip(one_scored[1:], two_scored[1:]):
            top_a = max(a, key=lambda t: a[t].logprob)
            assert top_a in b and b[top_a].logprob == pytest.approx(a[top_a].logprob, abs=2e-2)
