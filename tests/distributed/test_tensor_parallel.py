"""Tensor parallelism on the CPU (gloo): TP=2 gives the tokens TP=1 gives, on tiny random
models of every family; bad sizes fail at start; a worker that dies fails the engine.

Each family runs one TP=1 and one TP=2 engine and exercises a different part of the path:
KV heads split (llama) or replicated (qwen2, one KV head), tied heads and a vocabulary that
does not split evenly, dummy weights, async scheduling (pending ids from the sampled-ids
broadcast), prompt logprobs, n > 1 (copy-on-write), swap preemption of an FP8 cache with static
scales (each rank's heads). fp32, exact tokens.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rooflm import LLM
from rooflm.engine.executor import WorkerDied, check_tensor_parallel
from rooflm.engine.llm_engine import LLMEngine
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model

PROMPTS = [[5, 9, 33, 7, 81, 12], [100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [17]]

CASES = {
    # family, attention, model options, engine options
    "llama": ("gqa", {}, {"async_scheduling": True}),
    "qwen2": ("mqa", {"tied": True, "vocab_size": 250}, {}),
    "qwen3": ("mha", {}, {"load_format": "dummy"}),
    "mistral": ("gqa", {"tied": True}, {"preemption_mode": "swap", "num_blocks": 6, "block_size": 4,
                                        "swap_space_gb": 0.01, "reserve_new_tokens": False,
                                        "kv_cache_dtype": "fp8", "kv_cache_scales": "static"}),
}


def _run(path, tp: int, engine_options: dict, kill_worker: bool = False):
    llm = LLM(model=str(path), tensor_parallel_size=tp, dtype="float32", device="cpu",
              **engine_options)
    try:
        greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate(PROMPTS, greedy)
        extra = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=7,
                                                          ignore_eos=True, prompt_logprobs=1))[0]
        snapshot = llm.engine.snapshot()
        if kill_worker:  # after the parity run, to spare CI a second start
            _kill_a_worker_mid_request(llm.engine)
    finally:
        llm.shutdown()
    return outs, extra, snapshot


def _kill_a_worker_mid_request(engine: LLMEngine) -> None:
    """A worker that dies fails the engine's next steps (no hang), names the worker, and leaves
    no worker process behind."""
    worker = engine.executor.processes[0]
    engine.add_request("long", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises((WorkerDied, RuntimeError)):
        while time.monotonic() < deadline:
            engine.step()
    assert time.monotonic() < deadline
    with pytest.raises(WorkerDied, match="exited with code -9"):
        engine.check_alive()
    assert not any(p.is_alive() for p in engine.executor.processes)


@pytest.mark.parametrize("family", list(CASES))
def test_tp2_gives_the_tokens_of_tp1(tmp_path, family):
    attention, model_options, engine_options = CASES[family]
    path, _ = make_tiny_model(tmp_path, family, attention=attention, **model_options)
    one, one_extra, _ = _run(path, 1, engine_options)
    two, two_extra, snapshot = _run(path, 2, engine_options, kill_worker=family == "llama")
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    for a, b in zip(one, two):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_b[token].logprob == pytest.approx(lp_a[token].logprob, abs=1e-4)
    assert [s.token_ids for s in two_extra.outputs] == [s.token_ids for s in one_extra.outputs]
    assert len(two_extra.prompt_logprobs) == len(one_extra.prompt_logprobs)
    if family == "mistral":
        assert snapshot.num_preemptions > 0  # the swap path ran on every rank's pool


def test_sizes_that_cannot_split_fail_at_start(tmp_path):
    path, _ = make_tiny_model(tmp_path, "llama", attention="gqa")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(model=str(path), tensor_parallel_size=3, dtype="float32", device="cpu")
    from rooflm.model.loader import load_model_config
    cfg = load_model_config(str(path), "safetensors")
    with pytest.raises(ValueError, match="exceeds the .* visible GPU"):
        check_tensor_parallel(2 + torch.cuda.device_count(), cfg, torch.device("cuda"))
    with pytest.raises(ValueError, match="not a multiple of the model's 3 KV heads"):
        check_tensor_parallel(4, cfg.__class__(**{**cfg.__dict__, "num_attention_heads": 12,
                                                  "num_key_value_heads": 3}), torch.device("cpu"))


def test_roofline_and_memory_take_the_tensor_parallel_size(capsys):
    from rooflm.cli import main
    from rooflm.model.presets import PRESETS
    from rooflm.perf.roofline import phase_step_cost, roofline
    from rooflm.perf.gpus import get_gpu

    cfg = PRESETS["llama-3-8b"]
    one = phase_step_cost(cfg, "decode", 1, 1024)
    two = phase_step_cost(cfg, "decode", 1, 1024, tp=2, allreduce_latency_s=5e-6)
    comm = next(op for op in two.ops if op.name == "tp all-reduce")
    # 2 all-reduces per layer + the embedding's + the logits' gather, each paying the latency
    assert comm.latency_s == pytest.approx((2 * 32 + 2) * 5e-6)
    assert comm.bytes == pytest.approx(65 * 1 * 4096 * 2 + 0.5 * 128256 * 2)  # ring: 2(N-1)/N = 1
    link = next(r for r in roofline(two, get_gpu("h200")) if r.op.name == "tp all-reduce")
    assert link.floor_s == pytest.approx(comm.bytes / 450e9 + comm.latency_s)
    assert two.bytes < 0.55 * one.bytes  # per-rank weights: half, plus the replicated norms
    assert main(["roofline", "--model", "llama-3-8b", "--tensor-parallel-size", "2", "--gpu", "h200",
                 "--allreduce-latency-us", "5"]) == 0
    assert "66 collectives per step" in capsys.readouterr().out
    assert main(["memory", "--model", "llama-3-8b", "--tensor-parallel-size", "2", "--gpu", "h200"]) == 0
    assert "4 KV heads" in capsys.readouterr().out
