"""A tensor-parallel worker: ranks 1..N-1, each in its own process.

A worker is a ModelRunner over its shard of the model and its own KV pool. It goes through
the same start-up as rank 0 (weights, the memory profile, the KV pool, CUDA graphs: each has
collectives, so every rank runs them in the same order), then replays each step rank 0
broadcasts: block operations, inputs to its device, the forward (same graph / piecewise /
eager choice, from the same counts), the LM head's all-gather, and the sampled ids, which it
keeps for the next step's pending inputs. It never schedules and never samples.

It ends when rank 0 sends stop, and on its own when its parent process is gone (a watcher
thread polls the parent's pid), so a killed engine leaves no workers behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Optional

import torch

from rooflm.config import EngineConfig, ModelConfig
from rooflm.distributed.group import TPGroup, destroy_group, init_group
from rooflm.distributed.step_broadcast import StepChannel, StepPacket
from rooflm.engine.model_runner import HostInputs, ModelRunner, StepInputs, StepResult

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


class WorkerRunner(ModelRunner):
    """Rank r > 0's runner: replays the steps rank 0 describes."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tp: TPGroup):
        super().__init__(config, model_config, max_model_len, tp)
        self.prev_sampled: Optional[torch.Tensor] = None  # the last step's sampled ids, on the device

    @torch.inference_mode()
    def replay(self, packet: StepPacket) -> None:
        self.apply_block_ops(packet)  # the packet carries the SchedulerOutput's block lists
        host = HostInputs(input_ids=self._pin(packet.input_ids), positions=self._pin(packet.positions),
                          slot_mapping=self._pin(packet.slot_mapping),
                          query_start_loc=self._pin(packet.query_start_loc),
                          seq_lens=self._pin(packet.seq_lens), block_tables=self._pin(packet.block_tables))
        inputs = StepInputs(
            host=host, query_start_loc_cpu=packet.query_start_loc.tolist(),
            seq_lens_cpu=packet.seq_lens.tolist(), max_query_len=packet.max_query_len,
            num_decodes=packet.num_decodes, order=[], logits_indices=packet.logits_indices, rows=[],
            row_owner=[], prompt_logprob_spans=[(None, base, None, count)
                                                for base, count in packet.prompt_logprob_spans],
            pending_positions=[])
        fixup = None
        if packet.pending_positions:
            dst = self._host(packet.pending_positions, torch.int64).to(self.device, non_blocking=True)
            src = self._host(packet.pending_rows, torch.int64).to(self.device, non_blocking=True)
            fixup = (dst, self.prev_sampled.index_select(0, src))
        self._forward(inputs, StepResult({}, {}, {}), fixup, self._graph_runs(inputs))
        if packet.logits_indices:  # rank 0 sampled these rows: receive their ids
            sampled = torch.empty(len(packet.logits_indices), dtype=torch.int64, device=self.device)
            self.prev_sampled = self.tp.broadcast_device(sampled)

    def _prompt_logprobs(self, hidden, inputs, result) -> None:
        """Rank 0 computes prompt logprobs; the LM head's all-gather needs every rank."""
        for _, base, _, count in inputs.prompt_logprob_spans:
            self.model.compute_logits(hidden[base:base + count])


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on a GPU host (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if base.type == "cuda" else torch.device("cpu")


def run_worker(rank: int, size: int, init_method: str, config: EngineConfig, model_config: ModelConfig,
               max_model_len: int, model_path: str, load_format: str, parent_pid: int,
               log_level: int = logging.WARNING) -> None:
    """A worker process's entry point (multiprocessing spawn, or a torchrun rank > 0)."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s (tp rank {rank}): %(message)s")
    if parent_pid:
        _exit_with_parent(parent_pid)
    from rooflm.engine.model_runner import resolve_device
    # Under torchrun on several hosts a rank's GPU is its index on its own host.
    device = rank_device(resolve_device(config.device.device), int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = replace(config, device=replace(config.device, device=str(device)))
    tp = init_group(rank, size, init_method, device)
    runner = WorkerRunner(config, model_config, max_model_len, tp)
    runner.initialize(model_path, load_format)
    channel = StepChannel(tp)
    while (packet := channel.receive()) is not None:
        runner.replay(packet)
    destroy_group(tp)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="rooflm-tp-parent-watch", daemon=True).start()
