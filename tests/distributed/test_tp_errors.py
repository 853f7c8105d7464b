"""Tensor parallelism on the CPU (gloo): a worker that raises reaches rank 0 fast, with its rank
and traceback; the --tp-allreduce flag; the hang dump; leaving a group cannot hang.

The worker's failure is real: ROOFLM_TP_FAULT_INJECT=RANK:STEP makes that worker raise in
its STEP-th step, in its own process, the way any exception in a step would."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

from rooflm import LLM
from rooflm.config import ParallelConfig
from rooflm.distributed.allreduce import make_symm_all_reduce, reference_all_reduce
from rooflm.engine.executor import WorkerDied, _free_port
from rooflm.distributed.group import destroy_group, init_group
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model

PROMPTS = [[5, 9, 33, 7, 81, 12], [17, 4, 4, 90]]


def test_a_worker_that_raises_names_its_rank_and_traceback_fast(tmp_path, monkeypatch):
    path, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    monkeypatch.setenv("ROOFLM_TP_FAULT_INJECT", "1:3")  # read by the spawned worker
    llm = LLM(model=str(path), tensor_parallel_size=2, dtype="float32", device="cpu")
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        started = time.monotonic()
        with pytest.raises(WorkerDied) as failed:
            llm.generate(PROMPTS, params)
        elapsed = time.monotonic() - started
        # The pipe beats the collective's timeout (minutes) and the 5 s death grace by far;
        # 10 s leaves a loaded 2-core box its margin.
        assert elapsed < 10, f"WorkerDied took {elapsed:.1f} s"
        error = failed.value
        assert error.rank == 1
        assert "fault injected at tp rank 1 step 3" in error.traceback
        assert "Traceback (most recent call last)" in error.traceback
        assert "rank 1" in str(error) and "RuntimeError: fault injected" in str(error)
        # The engine stays usable for reporting: every later call names the same failure at once.
        started = time.monotonic()
        with pytest.raises(WorkerDied, match="fault injected at tp rank 1 step 3"):
            llm.engine.check_alive()
        with pytest.raises(WorkerDied, match="rank 1"):
            llm.generate(PROMPTS[:1], params)
        assert time.monotonic() - started < 2
        assert not any(p.is_alive() for p in llm.engine.executor.processes)
    finally:
        started = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - started < 5  # no stop handshake with a dead group


def test_the_fault_hook_rejects_a_malformed_value(monkeypatch):
    from rooflm.engine.worker import fault_step_from_env
    monkeypatch.setenv("ROOFLM_TP_FAULT_INJECT", "3")
    with pytest.raises(ValueError, match="ROOFLM_TP_FAULT_INJECT must be RANK:STEP"):
        fault_step_from_env(1)
    monkeypatch.setenv("ROOFLM_TP_FAULT_INJECT", "2:5")
    assert fault_step_from_env(1) is None and fault_step_from_env(2) == 5


def test_the_allreduce_flag_is_validated_and_the_cpu_falls_back_to_gloo(caplog):
    with pytest.raises(ValueError, match="tp_allreduce must be one of auto, nccl, symm; got 'fast'"):
        ParallelConfig(tensor_parallel_size=2, tp_allreduce="fast")
    from rooflm.engine_args import add_engine_args
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--tp-allreduce", "symm"]).tp_allreduce == "symm"
    with caplog.at_level(logging.WARNING, logger="rooflm.distributed.allreduce"):
        # On the CPU no collective runs before the answer, so no group is needed.
        assert make_symm_all_reduce("symm", 2, torch.device("cpu"), None, None) is None
    assert "--tp-allreduce symm needs CUDA GPUs; on cpu the all-reduces run on gloo" in caplog.text
    with pytest.raises(ValueError, match="tp_allreduce must be one of"):
        make_symm_all_reduce("one-shot", 2, torch.device("cpu"), None, None)


def test_the_reference_all_reduce_sums_in_fp32():
    parts = [torch.full((2, 4), 1.0, dtype=torch.bfloat16), torch.full((2, 4), 2.0 ** -9, dtype=torch.bfloat16)]
    out = reference_all_reduce(parts)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (parts[0].float() + parts[1].float()).bfloat16())


def test_tp2_runs_with_the_symm_flag_on_the_cpu(tmp_path):
    """--tp-allreduce symm on the CPU: the gloo path, the same tokens as TP=1."""
    path, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(model=str(path), tensor_parallel_size=tp, dtype="float32", device="cpu", tp_allreduce="symm")
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        finally:
            llm.shutdown()
    assert outs[1] == outs[2]


def test_the_hang_dump_prints_the_stacks_of_a_rank_without_progress(tmp_path):
    code = ("import time\n"
            "from rooflm.distributed.hang_dump import HangWatch\n"
            "watch = HangWatch(rank=1)\n"
            "for _ in range(8):\n"
            "    time.sleep(0.1)\n"
            "    watch.progress()\n"
            "def stuck_in_a_collective():\n"
            "    time.sleep(2.5)\n"
            "stuck_in_a_collective()\n")
    env = {**os.environ, "ROOFLM_HANG_DUMP_S": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "tp rank 1" in done.stderr and "ROOFLM_HANG_DUMP_S" in done.stderr
    assert "Timeout (0:00:01)!" in done.stderr
    assert "stuck_in_a_collective" in done.stderr  # the stack of where it waited
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "ROOFLM_HANG_DUMP_S": "soon"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "ROOFLM_HANG_DUMP_S must be a number of seconds, got 'soon'" in bad.stderr


def _join_and_never_leave(port: int) -> None:
    init_group(1, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    time.sleep(60)  # never meets rank 0 at the leaving barrier


def test_leaving_a_group_whose_peer_never_comes_is_bounded():
    port = _free_port()
    spawn = multiprocessing.get_context("spawn")
    peer = spawn.Process(target=_join_and_never_leave, args=(port,), daemon=True)
    peer.start()
    try:
        group = init_group(0, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
        started = time.monotonic()
        assert destroy_group(group, clean=True, timeout_s=1.0) is False  # the barrier never completes
        assert time.monotonic() - started < 5
    finally:
        peer.kill()
        peer.join()
    # The killed peer ends the abandoned barrier; leaving now completes, so the next test can
    # start a group in this process.
    assert destroy_group(group, clean=False, timeout_s=30.0) is True
    assert not torch.distributed.is_initialized()


def test_auto_needs_peer_access_on_one_host(monkeypatch):
    from rooflm.distributed.allreduce import peer_access
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun: 2 ranks, 1 on this host
    assert peer_access(2) == (False, "the 2 ranks span several hosts (1 on this one)")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    if torch.cuda.device_count() < 2:
        assert peer_access(2) == (False, "fewer than 2 visible GPUs")
