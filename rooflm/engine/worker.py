"""A tensor- or pipeline-parallel worker: ranks 1..N-1, each in its own process.

Under pipeline parallelism (distributed/pipeline.py) a worker holds its stage's layers and their
KV: after stage 0 it receives each step's activations from the stage before and sends them on
(the last stage sends the scored rows back to stage 0); stage 0's other TP ranks run the LM head
with rank 0, when rank 0 launches the step or, with batches in flight, when it sends FINISH.

A worker is a ModelRunner over its shard of the model and its own KV pool. It goes through
the same start-up as rank 0 (weights, the memory profile, the KV pool, CUDA graphs: each has
collectives, so every rank runs them in the same order), then replays each step rank 0
broadcasts: block operations, inputs to its device, the forward (same graph / piecewise /
eager choice, from the same counts), the LM head's all-gather, and the sampled ids, which it
keeps for the next step's pending inputs. It never schedules and never samples.

It ends when rank 0 sends stop (releasing its CUDA graphs before it leaves the group: NCCL
waits on graphs that captured its collectives), and on its own when its parent process is gone
(a watcher thread polls the parent's pid), so a killed engine leaves no workers behind. A
worker that raises sends its traceback to rank 0 through a pipe and exits (executor.py).
"""

from __future__ import annotations

import collections
import cProfile
import logging
import os
import pstats
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Optional

import torch

import rooflm.envs as envs
from rooflm.config import EngineConfig, ModelConfig
from rooflm.distributed.group import TPGroup, destroy_group
from rooflm.distributed.pipeline import configured_partition, init_parallel
from rooflm.distributed.hang_dump import HangWatch
from rooflm.distributed.step_broadcast import FINISH, StepChannel, StepPacket
from rooflm.engine.model_runner import HostInputs, ModelRunner, StepInputs, StepResult

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
FAULT_INJECT_ENV = "ROOFLM_TP_FAULT_INJECT"
STEP_TIMES_ENV = "ROOFLM_TP_STEP_TIMES"  # set: each worker prints where its host time went, at stop
PROFILE_ENV = "ROOFLM_TP_WORKER_PROFILE"  # a folder: each worker's step loop under cProfile, written at stop
MAX_TRACEBACK_CHARS = 20_000  # the tail: where it failed


class WorkerRunner(ModelRunner):
    """Rank r > 0's runner: replays the steps rank 0 describes."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tp: TPGroup,
                 stage=None, world: Optional[TPGroup] = None):
        super().__init__(config, model_config, max_model_len, tp, stage, world)
        # Pipeline stages after the first embed nothing: the pending ids and the sampled-ids
        # broadcast (stage 0's TP group) are not theirs.
        self.embeds = stage is None or stage.is_first
        # Stage 0 with batches in flight: steps whose LM head waits for rank 0's FINISH, oldest first.
        self.deferred: collections.deque[StepInputs] = collections.deque()
        self.prev_sampled: Optional[torch.Tensor] = None  # the last step's sampled ids, on the device
        self.kinds = {"graph": 0, "piecewise": 0, "eager": 0}  # how its forwards ran

    @torch.inference_mode()
    def replay(self, packet: StepPacket) -> None:
        self.apply_block_ops(packet)  # the packet carries the SchedulerOutput's block lists
        if self.lora is not None:
            self._replay_lora(packet)
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
        if packet.pending_positions and self.embeds:
            dst = self._host(packet.pending_positions, torch.int64).to(self.device, non_blocking=True)
            src = self._host(packet.pending_rows, torch.int64).to(self.device, non_blocking=True)
            fixup = (dst, self.prev_sampled.index_select(0, src))
        graph = self._pick_graph(inputs, fixup)
        self.kinds[_kind(graph, self._piecewise_runs(inputs))] += 1
        if self.defers_return:
            self._forward_stage(inputs, fixup)
            self.deferred.append(inputs)
            return
        self._forward(inputs, StepResult({}, {}, {}), fixup, graph, gather=False)
        if inputs.logits_indices and self.embeds:
            self._receive_sampled(len(inputs.logits_indices))

    @torch.inference_mode()
    def finish_oldest(self) -> None:
        """Rank 0 finishes its oldest batch in flight (FINISH): on stage 0, this rank's part of
        it: the rows back from its peer on the last stage, the LM head's all-gather, the ids."""
        if not self.defers_return:
            return  # another stage's rank: nothing of it is left here
        inputs = self.deferred.popleft()
        self._score(self._receive_final(inputs), inputs, StepResult({}, {}, {}))
        if inputs.logits_indices:
            self._receive_sampled(len(inputs.logits_indices))

    def _receive_sampled(self, rows: int) -> None:
        """Rank 0 sampled these rows: their ids, for the next step's pending inputs."""
        sampled = torch.empty(rows, dtype=torch.int64, device=self.device)
        self.prev_sampled = self.tp.broadcast_device(sampled)

    def _replay_lora(self, packet: StepPacket) -> None:
        """Rank 0's slot writes and token -> slot map, on this rank's shard of the slot pool."""
        from rooflm.lora.request import LoRARequest

        for slot, lora_id, name, path in packet.lora_writes:
            self.lora.write_slot(slot, LoRARequest(name, lora_id, path))
        if packet.lora_token_slots:
            num_seqs = packet.seq_lens.numel()
            self.lora_mapping.set_step(packet.lora_token_slots, decode_only=packet.num_decodes == num_seqs)
        else:
            self.lora_mapping.clear()

    def _prompt_logprobs(self, hidden, inputs, result) -> None:
        """Rank 0 computes prompt logprobs; the LM head's all-gather needs every rank."""
        for _, base, _, count in inputs.prompt_logprob_spans:
            self.model.compute_logits(hidden[base:base + count])


def _kind(graph, piecewise: bool) -> str:
    return "graph" if graph is not None else ("piecewise" if piecewise else "eager")


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on a GPU host (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if base.type == "cuda" else torch.device("cpu")


def run_worker(rank: int, size: int, init_method: str, config: EngineConfig, model_config: ModelConfig,
               max_model_len: int, model_path: str, load_format: str, parent_pid: int,
               log_level: int = logging.WARNING, error_pipe=None) -> None:
    """A worker process's entry point (multiprocessing spawn, or a torchrun rank > 0).

    error_pipe: the sending end of a pipe to rank 0 (spawned workers). A worker that raises
    sends its traceback there and exits at once: rank 0's watcher reads it and raises
    WorkerDied naming this rank, rather than waiting in a collective this rank left."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s (tp rank {rank}): %(message)s")
    watch = HangWatch(rank)
    if parent_pid:
        _exit_with_parent(parent_pid)
    try:
        _serve(rank, size, init_method, config, model_config, max_model_len, model_path, load_format, watch)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then the process ends
        text = traceback.format_exc()
        logger.error("tensor-parallel worker rank %d failed:\n%s", rank, text)
        if error_pipe is not None:
            try:
                error_pipe.send(WorkerError(rank, f"{type(exc).__name__}: {exc}", text[-MAX_TRACEBACK_CHARS:]))
                error_pipe.close()
            except (OSError, ValueError):  # rank 0 is gone: nobody to tell
                pass
        # Not a normal exit: tearing down NCCL under peers mid-collective can hang, and rank 0
        # stops the group anyway. Flush what was logged and leave.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    watch.stop()


def run_ray_worker(rank: int, size: int, init_method: str, config: EngineConfig,
                   model_config: ModelConfig, max_model_len: int, model_path: str, load_format: str,
                   log_level: int = logging.WARNING, error_pipe=None) -> None:
    """A worker's entry point on a Ray node (executor.py): its parent is the actor that
    started it, whose end (the driver exited, the actor was killed) ends it too. error_pipe:
    a pipe to that actor, which hands the WorkerError back to rank 0 through Ray."""
    run_worker(rank, size, init_method, config, model_config, max_model_len, model_path,
               load_format, os.getppid(), log_level, error_pipe)


def _serve(rank: int, size: int, init_method: str, config: EngineConfig, model_config: ModelConfig,
           max_model_len: int, model_path: str, load_format: str, watch: HangWatch) -> None:
    from rooflm.engine.model_runner import resolve_device
    # Under torchrun on several hosts a rank's GPU is its index on its own host.
    device = rank_device(resolve_device(config.device.device), int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # A GPU worker's CPU work is small tensors (a step's inputs); an intra-op pool of every
        # core beside rank 0's made each such op take ~1 ms (pin_memory, int casts: 12 ms a
        # decode step at 355 sequences on H200 x2, cProfile), so one thread, as vLLM's workers.
        torch.set_num_threads(1)
    config = replace(config, device=replace(config.device, device=str(device)))
    parallel = config.parallel
    layers = configured_partition(model_config.num_hidden_layers, parallel.pipeline_parallel_size)
    groups = init_parallel(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, init_method,
                           device, parallel.tp_allreduce, layers)
    runner = WorkerRunner(config, model_config, max_model_len, groups.tp, groups.stage, groups.world)
    runner.initialize(model_path, load_format)
    channel = StepChannel(groups.world)
    fault_step = fault_step_from_env(rank)
    steps, waited, busy = 0, 0.0, 0.0
    profile_dir = envs.get(PROFILE_ENV)
    profiler = cProfile.Profile() if profile_dir else None
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    while (packet := channel.receive()) is not None:
        t1 = time.perf_counter()
        watch.progress()
        steps += 1
        if steps == fault_step:
            raise RuntimeError(f"fault injected at tp rank {rank} step {steps} ({FAULT_INJECT_ENV})")
        if packet is FINISH:
            runner.finish_oldest()
        else:
            runner.replay(packet)
        t0, waited, busy = time.perf_counter(), waited + t1 - t0, busy + time.perf_counter() - t1
    if profiler is not None:
        profiler.disable()
        _write_profile(profiler, profile_dir, rank)
    if envs.get(STEP_TIMES_ENV):
        # Where rank 0's step goes if the GPUs wait for this rank: a host that is busy close to
        # the step time is the limit; one that mostly waits for the next packet is not.
        print(f"tp rank {rank}: {steps} steps, host busy {busy:.3f} s ({1e3 * busy / max(steps, 1):.2f} ms/step), "
              f"waiting for packets {waited:.3f} s; forwards {runner.kinds}", file=sys.stderr, flush=True)
    watch.arm()  # the teardown gets its own N seconds
    runner.release_graphs()  # before the group goes: NCCL waits on graphs that captured it
    if not destroy_group(groups.world):
        os._exit(0)  # a stuck NCCL teardown: rank 0 asked to stop, so leave without it


def _write_profile(profiler: "cProfile.Profile", folder: str, rank: int) -> None:
    """The worker's step loop: pstats for snakeviz/pstats, and the top functions as text."""
    os.makedirs(folder, exist_ok=True)
    profiler.dump_stats(os.path.join(folder, f"worker-rank{rank}.pstats"))
    with open(os.path.join(folder, f"worker-rank{rank}.txt"), "w") as f:
        stats = pstats.Stats(profiler, stream=f)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)


@dataclass(frozen=True)
class WorkerError:
    """What a failing worker sends rank 0."""

    rank: int
    summary: str  # "ExceptionType: message"
    traceback: str


def fault_step_from_env(rank: int) -> Optional[int]:
    """Test hook: ROOFLM_TP_FAULT_INJECT=RANK:STEP makes worker RANK raise at its STEP-th step."""
    value = envs.get(FAULT_INJECT_ENV)
    if value is None or value[0] != rank:
        return None
    step = value[1]
    logger.warning("%s=%d:%d: tp rank %d will raise at step %d (test hook)", FAULT_INJECT_ENV, rank, step, rank, step)
    return step


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="rooflm-tp-parent-watch", daemon=True).start()
