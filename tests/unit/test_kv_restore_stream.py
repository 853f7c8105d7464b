"""Host-tier restores staged ahead on a side CUDA stream (ModelRunner.apply_block_ops): which
restores go ahead, and on a GPU that what they copy is what the host block holds when the step
that needs it runs: after an earlier step's offload into that block (queued behind a busy step's
stream), and, for a block this step's own offloads write, after that write (in order)."""

import types

import pytest
import torch

from rooflm import LLM
from rooflm.engine import model_runner as mr
from rooflm.engine.model_runner import ModelRunner
from rooflm.engine.scheduler import SchedulerOutput
from tests.models.tiny_models import make_tiny_model

TIER_GB = 2**-10


def fake_runner(num_host_blocks: int, block_bytes: int):
    host = torch.empty(num_host_blocks, block_bytes, dtype=torch.uint8)
    return types.SimpleNamespace(device=torch.device("cuda"), _pools=lambda: [(None, host)])


def test_restores_of_blocks_this_step_writes_stay_in_order():
    runner = fake_runner(8, 1024)
    out = SchedulerOutput(blocks_to_swap_out=[(0, 3)], blocks_to_swap_in=[(3, 1), (4, 2), (5, 6)])
    assert ModelRunner._split_restores(runner, out) == ([(4, 2), (5, 6)], [(3, 1)])


def test_restores_beyond_the_staging_bound_stay_in_order(monkeypatch):
    monkeypatch.setattr(mr, "RESTORE_AHEAD_BYTES", 2 * 1024)
    out = SchedulerOutput(blocks_to_swap_in=[(1, 1), (2, 2), (3, 3)])
    assert ModelRunner._split_restores(fake_runner(8, 1024), out) == ([(1, 1), (2, 2)], [(3, 3)])


def test_the_cpu_copies_every_restore_in_order():
    runner = types.SimpleNamespace(device=torch.device("cpu"))
    out = SchedulerOutput(blocks_to_swap_in=[(1, 1), (2, 2)])
    assert ModelRunner._split_restores(runner, out) == ([], [(1, 1), (2, 2)])


@pytest.fixture(scope="module")
def cuda_runner(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("restore"), "llama")
    llm = LLM(model=path, device="cuda", dtype="bfloat16", block_size=4, num_blocks=16, kv_offload_gb=TIER_GB)
    return llm.engine.runner


def _fill(runner, device_blocks, host_blocks):
    """Fresh random contents in the device blocks, NaN in the host blocks; returns the device
    blocks' contents."""
    pool, host = runner.kv_cache, runner.host_kv_cache
    for d in device_blocks:
        pool[:, :, d] = torch.randn_like(pool[:, :, d])
    for h in host_blocks:
        host[h] = float("nan")
    torch.cuda.synchronize()
    return {d: pool[:, :, d].clone() for d in device_blocks}


@pytest.mark.gpu
def test_a_restore_ahead_waits_for_an_earlier_steps_offload(cuda_runner):
    runner = cuda_runner
    before = _fill(runner, [3], [5])
    torch.cuda._sleep(100_000_000)  # a busy step: the offload below queues behind it
    runner.apply_block_ops(SchedulerOutput(blocks_to_swap_out=[(3, 5)]))
    out = SchedulerOutput(blocks_to_swap_in=[(5, 7)])
    assert ModelRunner._split_restores(runner, out)[0] == [(5, 7)]
    runner.apply_block_ops(out)
    torch.cuda.synchronize()
    assert torch.equal(runner.kv_cache[:, :, 7], before[3])
    assert runner._copy_stream is not None


@pytest.mark.gpu
def test_a_restore_of_a_block_offloaded_in_the_same_step_reads_the_new_contents(cuda_runner):
    runner = cuda_runner
    before = _fill(runner, [2], [9])
    torch.cuda._sleep(100_000_000)
    runner.apply_block_ops(SchedulerOutput(blocks_to_swap_out=[(2, 9)], blocks_to_swap_in=[(9, 11)]))
    torch.cuda.synchronize()
    assert torch.equal(runner.kv_cache[:, :, 11], before[2])


@pytest.mark.gpu
def test_a_later_offload_into_a_restored_host_block_comes_after_the_restore(cuda_runner):
    runner = cuda_runner
    first = _fill(runner, [1], [4])
    runner.apply_block_ops(SchedulerOutput(blocks_to_swap_out=[(1, 4)]))
    second = _fill(runner, [0], [])
    runner.apply_block_ops(SchedulerOutput(blocks_to_swap_in=[(4, 8)]))  # ahead, on the side stream
    runner.apply_block_ops(SchedulerOutput(blocks_to_swap_out=[(0, 4)]))  # the next step reuses host block 4
    runner.apply_block_ops(SchedulerOutput(blocks_to_swap_in=[(4, 12)]))
    torch.cuda.synchronize()
    assert torch.equal(runner.kv_cache[:, :, 8], first[1])
    assert torch.equal(runner.kv_cache[:, :, 12], second[0])
