"""Pipeline parallelism: the decoder's layers split into stages, activations sent stage to stage.

Ranks: PP stages of TP ranks each, rank = stage * TP + tp_rank (TP innermost, as vLLM lays
them out, so a stage's TP group sits on neighbouring GPUs). Global rank 0 is the engine: it
schedules, broadcasts each step's description to every other rank over one host (gloo) group
(step_broadcast.py, unchanged) and samples.

Where the model's parts live:
  stage 0             the embedding, its layers, and the LM head (with the sampler beside it)
  stage 1 .. PP-2     their layers
  the last stage      its layers and the final norm
The head sits with the sampler rather than on the last stage (vLLM's place): what comes back
from the last stage is then the final hidden states of the rows that are scored, [rows, hidden]
(prompt-logprob rows included), not [rows, vocab] logits; the sampler, its seeded generators,
penalties, grammars and logprobs stay where they were, and a tied head needs no copy of the
embedding on a second stage.

A step's data path: every rank gets the step from rank 0's broadcast; stage s > 0 receives
[2, tokens, hidden] (hidden states and residual stream: the residual stays separate, so the
next layer's fused add + norm sees exactly what one device would) from tp_rank's peer on stage
s - 1, runs its layers, sends to stage s + 1; the last stage sends the scored rows back to its
peer on stage 0. Each rank knows every shape from the step's description, so nothing but the
tensors crosses. Point-to-point runs on the world's device group (NCCL on CUDA, gloo on the CPU).

Each stage allocates KV only for its layers: the pools hold the same number of blocks (one block
table for every rank), the least any rank can hold.

Batches in flight (ParallelConfig.batches_in_flight, vLLM's virtual engines): the scheduler keeps
a sequence out of the next batches until its sampled token reaches the host, so the batches in
flight hold different requests, and nothing crosses from one to the next but the KV cache, which
each stage reads and writes in the order the batches arrive. Stage 0 then runs forward() for
batch B before receive_final() for batch A (engine/step_strategy.PipelineStep); its other TP
ranks follow rank 0's FINISH message (step_broadcast.py) to run the LM head with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from rooflm.distributed.group import TPGroup

logger = logging.getLogger(__name__)


def even_partition(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: an even split, the remainder one each to the last stages (stage 0
    also runs the embedding, the LM head and the sampler)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]


def layer_partition(num_layers: int, num_stages: int,
                    override: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers; override: the layer count of each stage
    (ROOFLM_PP_LAYER_PARTITION). Raises ValueError naming what does not fit."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers "
                         f"(each stage needs at least one)")
    counts = list(override) if override is not None else even_partition(num_layers, num_stages)
    if len(counts) != num_stages:
        raise ValueError(f"ROOFLM_PP_LAYER_PARTITION names {len(counts)} stages but "
                         f"pipeline_parallel_size is {num_stages}")
    if sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"ROOFLM_PP_LAYER_PARTITION {','.join(map(str, counts))} must give each stage at "
                         f"least one layer and sum to the model's {num_layers} layers")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [(start, start + n) for start, n in zip(starts, counts)]


def configured_partition(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """layer_partition with ROOFLM_PP_LAYER_PARTITION's override, if set."""
    from rooflm import envs
    return layer_partition(num_layers, num_stages, envs.get("ROOFLM_PP_LAYER_PARTITION"))


@dataclass(frozen=True)
class StageLayout:
    """What one stage's model holds: a layer range, and which of the ends."""

    start: int
    end: int
    has_embedding: bool  # stage 0: the token lookup
    has_head: bool  # stage 0: the LM head, beside the sampler
    has_final_norm: bool  # the last stage

    def holds_layer(self, layer: int) -> bool:
        return self.start <= layer < self.end

    @property
    def whole(self) -> bool:
        return self.has_embedding and self.has_final_norm


WHOLE_MODEL = None  # a model without a StageLayout holds everything


class PipelineStage:
    """A rank's place in the pipeline and the point-to-point transfers of its activations."""

    def __init__(self, stage: int, num_stages: int, tp_rank: int, tp_size: int,
                 layers: tuple[int, int], device_group=None, return_group=None):
        self.stage = stage
        self.num_stages = num_stages
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.start, self.end = layers
        self.device_group = device_group  # the world's: NCCL on CUDA, gloo on the CPU; stage to stage
        # The last stage's sends back to stage 0 go over a group of their own: with two stages
        # they link the same pair of ranks as the forward sends, and NCCL would queue both
        # directions on one communicator's stream, the return behind the next forward send.
        self.return_group = return_group if return_group is not None else device_group
        self._sends: list = []  # (Work, tensor) of sends not known to have completed

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def layout(self) -> StageLayout:
        return StageLayout(self.start, self.end, has_embedding=self.is_first, has_head=self.is_first,
                           has_final_norm=self.is_last)

    def global_rank(self, stage: int) -> int:
        """This TP rank's peer on `stage`."""
        return stage * self.tp_size + self.tp_rank

    def run(self, model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
            scored_rows: list[int], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """This stage's part of a step, to the end: forward(), then on stage 0 receive_final()
        (the final hidden states [tokens, hidden], None on the other stages)."""
        self.forward(model, input_ids, positions, kv_caches, meta, scored_rows, dtype)
        if not self.is_first:
            return None
        return self.receive_final(input_ids.shape[0], scored_rows, model.cfg.hidden_size, dtype, input_ids.device)

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                scored_rows: list[int], dtype: torch.dtype) -> None:
        """Receive the step's activations (after stage 0), run this stage's layers, send them on,
        or from the last stage send the scored rows' final hidden states back to stage 0."""
        num_tokens = input_ids.shape[0]
        intermediate = None
        if not self.is_first:
            received = torch.empty((2, num_tokens, model.cfg.hidden_size), dtype=dtype, device=input_ids.device)
            dist.recv(received, src=self.global_rank(self.stage - 1), group=self.device_group)
            intermediate = (received[0], received[1])
        out = model(input_ids, positions, kv_caches, meta, intermediate=intermediate)
        if not self.is_last:
            x, residual = out
            self._send(torch.stack((x, residual)), self.global_rank(self.stage + 1), self.device_group)
        elif scored_rows:
            self._send(out.index_select(0, _on_device(scored_rows, out.device)), self.global_rank(0), self.return_group)

    def receive_final(self, num_tokens: int, scored_rows: list[int], hidden_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """Stage 0: the last stage's final hidden states of a step's scored rows, in a [tokens,
        hidden] tensor at their packed places (the other rows are zeros and never read)."""
        hidden = torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
        if scored_rows:
            final = torch.empty((len(scored_rows), hidden_size), dtype=dtype, device=device)
            dist.recv(final, src=self.global_rank(self.num_stages - 1), group=self.return_group)
            hidden.index_copy_(0, _on_device(scored_rows, device), final)
        return hidden

    def _send(self, tensor: torch.Tensor, dst: int, group) -> None:
        """Send without waiting for the receiver. With micro-batches in flight, stage 0 sends
        batch B on while the last stage sends batch A back: a send that waited for its receive
        would hold each side in its send (gloo blocks the host; an NCCL send blocks its stream).
        The tensor and its Work stay referenced until the transfer completes."""
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, dst=dst, group=group), tensor))

    def wait_sends(self) -> None:
        """Wait until every send has completed (teardown: a peer still receiving)."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 indices on the device through pinned memory: a copy from pageable memory would make
    the host wait for the stream's earlier work (this stage's layers) before it returns."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def scored_rows(logits_indices: Sequence[int], prompt_logprob_spans: Sequence[tuple[int, int]]) -> list[int]:
    """The packed token indices whose final hidden states stage 0 scores: the sampling rows'
    and each prompt-logprob span's (base, count), sorted and once each."""
    rows = set(logits_indices)
    for base, count in prompt_logprob_spans:
        rows.update(range(base, base + count))
    return sorted(rows)


@dataclass
class ParallelGroups:
    """A process's groups: its TP group (its stage's), the world (every rank: the step
    broadcast, the agreement on the pool size, teardown) and its pipeline stage (None: PP=1)."""

    tp: "TPGroup"
    world: "TPGroup"
    stage: Optional[PipelineStage] = None


def init_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
                  allreduce: str, layers: Sequence[tuple[int, int]]) -> ParallelGroups:
    """Join the world of pp_size * tp_size ranks (blocks until all have). With one stage the
    TP group is the world, exactly as tensor parallelism alone starts it."""
    from rooflm.distributed.group import (COLLECTIVE_TIMEOUT, IDLE_TIMEOUT, TPGroup, init_group, new_subgroup,
                                          start_world)

    if pp_size == 1:
        tp = init_group(rank, tp_size, init_method, device, allreduce)
        return ParallelGroups(tp, tp)
    world_size = tp_size * pp_size
    device_group, host_group = start_world(rank, world_size, init_method, device)
    world = TPGroup(rank, world_size, device_group, host_group)
    return_group = new_subgroup(None, None, COLLECTIVE_TIMEOUT if device.type == "cuda" else IDLE_TIMEOUT)
    stage, tp_rank = divmod(rank, tp_size)
    tp = TPGroup(tp_rank, 1, root=rank)
    if tp_size > 1:
        nccl = device.type == "cuda"
        for s in range(pp_size):  # every rank creates every stage's groups, in order
            ranks = list(range(s * tp_size, (s + 1) * tp_size))
            dev = new_subgroup(ranks, None, COLLECTIVE_TIMEOUT if nccl else IDLE_TIMEOUT)
            host = new_subgroup(ranks, "gloo", IDLE_TIMEOUT) if nccl else dev
            if s == stage:
                tp = TPGroup(tp_rank, tp_size, dev, host, root=ranks[0])
        if allreduce == "symm" and nccl:
            # Its set-up checks peer access of GPUs 0..TP-1, not a stage's own GPUs.
            logger.warning("--tp-allreduce symm is not wired under pipeline parallelism yet: NCCL all-reduces")
    logger.info("pipeline parallelism: stage %d of %d (layers %d-%d), tp rank %d of %d",
                stage, pp_size, layers[stage][0], layers[stage][1] - 1, tp_rank, tp_size)
    return ParallelGroups(tp, world, PipelineStage(stage, pp_size, tp_rank, tp_size, layers[stage], device_group,
                                                   return_group))
