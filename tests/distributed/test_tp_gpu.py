"""Tensor parallelism on 2 GPUs (NCCL): TP=2 gives the greedy tokens TP=1 gives, fp32, on a
small random model, through every way a step runs on CUDA: the batch-1 GEMV layers (row-parallel
partial sums with the residual on rank 0), the decode CUDA graphs with their all-reduces
captured, the piecewise graphs of prefill steps, and async scheduling (the sampled-ids broadcast).

fp32 on CUDA multiplies in TF32 (the runner allows it), and TP=2 sums each row-parallel product
in two halves: logits differ from TP=1's in the last bits. Tokens are compared one by one; where a
sequence diverges, both tokens must be a near tie in both runs (vLLM's check_logprobs_close),
and every sequence must agree on its first 8 tokens. TP=2 runs with each all-reduce: NCCL, and
the one-shot kernel over symmetric memory where the GPUs have peer access. Each engine's
shutdown must finish in SHUTDOWN_LIMIT_S: on 2026-11-23 NCCL's teardown waited on the live CUDA
graphs that captured its all-reduces and hung (ModelRunner.release_graphs now goes first).
Run by benchmarks/tp.sh (pytest -m gpu)."""

from __future__ import annotations

import time

import pytest
import torch

from rooflm import LLM
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

SHUTDOWN_LIMIT_S = 30.0

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             vocab_size=1000)


def _outputs(path, tp: int, prompts, max_tokens: int, allreduce: str = "auto"):
    llm = LLM(model=str(path), tensor_parallel_size=tp, dtype="float32", max_model_len=512,
              max_num_seqs=16, tp_allreduce=allreduce)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
        batch = [o.outputs[0] for o in llm.generate(prompts, params)]
        single = llm.generate([prompts[0]], params)[0].outputs[0]  # batch 1: the GEMV path
        if tp > 1:
            symm = llm.engine.executor.tp.symm
            assert (symm is not None) == (allreduce == "symm"), "the all-reduce asked for did not run"
        return batch + [single]
    finally:
        started = time.monotonic()
        llm.shutdown()
        took = time.monotonic() - started
        print(f"tp={tp} {allreduce}: shutdown took {took:.1f} s")
        assert took < SHUTDOWN_LIMIT_S


def _check_close(one, two) -> None:
    for a, b in zip(one, two):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert i >= 8, f"diverged at token {i}: {a.token_ids} vs {b.token_ids}"
                assert x in b.logprobs[i] and y in a.logprobs[i], f"not a near tie at token {i}"
                break


def _outputs_in_fresh_process(*args):
    """_outputs in a process of its own: torch numbers symmetric-memory rendezvous keys per
    process (rooflm/distributed/allreduce.py), so a symm engine after another in this process
    would use NCCL (with a warning) instead of the path under test."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_outputs, *args).result()


def _allreduces() -> list[str]:
    from rooflm.distributed.allreduce import peer_access, symm_op_available
    return ["nccl", "symm"] if peer_access(2)[0] and symm_op_available() else ["nccl"]


@pytest.mark.parametrize("family,attention", [("llama", "gqa"), ("qwen2", "mqa")])
def test_tp2_equals_tp1_on_two_gpus(tmp_path, family, attention):
    path, _ = make_tiny_model(tmp_path, family, attention=attention, **SMALL)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 40, 120)]
    one = _outputs(path, 1, prompts, 24)
    for allreduce in _allreduces():
        run = _outputs_in_fresh_process if allreduce == "symm" else _outputs
        two = run(path, 2, prompts, 24, allreduce)
        _check_close(one, two)
        exact = sum(a.token_ids == b.token_ids for a, b in zip(one, two))
        print(f"{family} ({allreduce}): {exact} of {len(one)} sequences token-for-token equal")
