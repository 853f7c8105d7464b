"""Speculative decoding's device loop: verify steps queued without a host round trip.

Why
---
A verify step's accepted tokens decide the next step's inputs, so on the host path
(spec/decoder.py) a verifying step runs synchronously: the host reads its tokens, processes
them, proposes and prepares the next step while the GPU waits. On the H100 at batch 1
(Llama-3-8B shape, k = 4) that wait was 0.69 ms of a 7.09 ms step, and the host-launched
sampling after the forward ~0.4 ms more (benchmarks/results/spec-loop-h100-20261126/). Here
each sequence's tokens and length also live on the device, so a step's inputs follow from the
last step's results there, and the host queues step t + 1 before it reads step t, as async
scheduling does for plain steps.

A step, for the B sequences in the loop's slots (K drafts, W = K + 1 rows each):
  1. propose: the proposer's device form (proposer.DeviceProposer) drafts from the histories
     into drafts [B, K] and num_drafts [B];
  2. prepare: slot b's W rows are its last token and its K drafts (missing drafts are computed
     and never accepted) at positions length - 1 .. length - 1 + K, slots from its block table;
  3. the verify forward and the LM head, every row;
  4. accept: a greedy slot's draft stands while it is the argmax of the row before it; a sampled
     slot's (temperature only) by speculative sampling, with layers/rejection.py's test and residual
     for point-mass drafts: u < p(d), else a draw from p without d. The accepted drafts and the token after
     them are appended to the history, the length advances, and the step's tokens, counts and
     drafts are packed for one copy to the host.
On CUDA, 2-4 are one CUDA graph per batch size (and a second one with the draws, for batches of at
most MAX_SAMPLED_BATCH that sample); the proposer runs just before it, outside,
because benchmarks swap proposers. The engine processes step t's tokens through its usual path
(output processor, stop checks, spec statistics, step reports) while step t + 1 runs. Blocks are
allocated two steps ahead (a step writes at most W more K/V), and the rollback after a verify
step keeps them while a later step is in flight (Sequence.num_lookahead_tokens).

When it runs (the engine asks each step): every running request decodes one sequence, greedy or
by temperature alone (no seed, top-k, top-p, min-p), with no logprobs, penalties, bias, grammar or
pending min_tokens (loop_sampling); nothing waits or is swapped
out; the policy wants the full K; the step in flight cannot end any sequence at max_tokens (a
slot stops exactly there on the device: drafts are cut to fit) and two steps fit the context;
the proposer has a device form. Anything else (a new request, a finished or aborted sequence) ends the loop after
the step in flight, and the engine goes on with its host path. Greedy tokens are the host
path's (the same forward rows and the same argmax); sampled ones follow the same distribution
(tests/unit/test_spec_loop.py's chi-square test).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from rooflm.engine.block_manager import slot_of
from rooflm.engine.request import Request, RequestStatus, Sequence
from rooflm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from rooflm.layers.attention import AttentionMetadata
from rooflm.layers.rejection import accept_drafts, point_mass_residual_
from rooflm.layers.sampler import sample_from_probs
from rooflm.spec.proposer import DeviceProposer

logger = logging.getLogger(__name__)


# Sampled slots draw over [rows, vocab] fp32 tensors inside the graph: batches up to this many
# sequences (a few hundred MB of the graph pool at 128k vocabularies beyond it).
MAX_SAMPLED_BATCH = 16


def loop_sampling(req: Request) -> Optional[str]:
    """How the loop can take a request: "greedy" (argmaxes of the raw logits), "temperature"
    (draws from softmax(logits / T): no top-k, top-p or min-p, no seed), or None: the host path
    (n > 1, logprobs, a grammar, penalties, bias, a seed, pending min_tokens, a LoRA adapter:
    the loop's forward, captured once, has no adapter map)."""
    p = req.params
    if len(req.seqs) != 1 or p.n != 1 or req.grammar is not None or req.lora_request is not None:
        return None
    if p.logprobs is not None or p.logit_bias or p.structured_outputs is not None:
        return None
    if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        return None
    if req.seqs[0].num_output_tokens < p.min_tokens:
        return None
    if p.greedy:
        return "greedy"
    if p.seed is None and p.top_k in (0, -1) and p.top_p == 1.0 and p.min_p == 0.0:
        return "temperature"
    return None


@dataclass
class LoopStep:
    """A launched loop step: what the engine's _InFlight holds as its handle."""

    out: SchedulerOutput  # one ScheduledSeq per slot; start and drafts filled at collect
    host: torch.Tensor  # [slots, 2W + 1] int64: tokens (W), count, drafts (K), number of drafts
    ready: Optional[torch.cuda.Event]
    graph: str
    keep: list = field(default_factory=list)  # pinned uploads the device has yet to read
    needs_bitmask = False  # never a grammar in the loop (loop_sampling): as StepHandle's


class SpecLoop:
    def __init__(self, runner, k: int, max_tokens: int, max_seqs: int, max_model_len: int):
        self.runner = runner
        self.k, self.width = k, k + 1
        self.max_model_len = max_model_len
        self.block_size = runner.block_size
        self.max_batch = max(1, min(max_seqs, max_tokens // self.width))
        dev = self.device = runner.device
        b, w = self.max_batch, self.width
        self.max_blocks = -(-max_model_len // self.block_size)
        self.hist = torch.zeros(b, max_model_len, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(b, dtype=torch.int64, device=dev)
        self.active = torch.zeros(b, dtype=torch.bool, device=dev)
        # Slot b stops at limit[b] tokens (prompt + max_tokens, within the context): a step
        # drafts no further and a slot that reached it computes nothing (live false).
        self.limit = torch.zeros(b, dtype=torch.int64, device=dev)
        self.live = torch.zeros(b, dtype=torch.bool, device=dev)
        self.drafts = torch.zeros(b, k, dtype=torch.int64, device=dev)
        self.num_drafts = torch.zeros(b, dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(b * w, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b * w, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((b * w,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((b,), w, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(0, (b + 1) * w, w, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev)
        self.pack = torch.zeros(b, 2 * w + 1, dtype=torch.int64, device=dev)
        self.inv_temp = torch.zeros(b, dtype=torch.float32, device=dev)  # 0: a greedy slot
        self.cols_w = torch.arange(w, device=dev)
        self.cols_k = torch.arange(k, device=dev)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch, sampled)
        self.sampled = False  # the slots' steps draw (some slot samples)
        self.slots: list[tuple[Request, Sequence]] = []
        self.size = 0  # the slots the steps run (a captured batch size >= len(slots))
        self.proposer: Optional[DeviceProposer] = None
        self._versions: list[int] = []
        self.num_steps = self.num_entries = 0  # since start (tests, benchmarks)

    # ---- the device step -------------------------------------------------------------------

    def _prepare(self, b: int) -> None:
        if self.device.type == "cuda":
            from rooflm.kernels.spec_loop_step import prepare_step
            prepare_step(self, b)
        else:
            self._prepare_torch(b)

    def _prepare_torch(self, b: int) -> None:
        """Step 2 in torch ops: the CPU path, and the reference of kernels/spec_loop_step.py."""
        w, k, bs = self.width, self.k, self.block_size
        lengths = self.lengths[:b]
        live = self.live[:b]
        live.copy_(self.active[:b] & (lengths < self.limit[:b]))
        self.num_drafts[:b].copy_(torch.minimum(self.num_drafts[:b], (self.limit[:b] - lengths - 1).clamp_min(0)))
        active = live[:, None]
        last = (lengths - 1).clamp_min(0)
        pos = last[:, None] + self.cols_w[None, :]
        ids = torch.cat([self.hist[:b].gather(1, last[:, None]).long(), self.drafts[:b]], dim=1)
        blocks = self.block_tables[:b].gather(1, (pos // bs).clamp_max(self.max_blocks - 1)).long()
        slots = slot_of(blocks, pos, bs)
        self.input_ids[:b * w].copy_(torch.where(active, ids, 0).flatten())
        self.positions[:b * w].copy_(torch.where(active, pos, self.cols_w[None, :]).flatten())
        self.slot_mapping[:b * w].copy_(torch.where(active, slots, -1).flatten())
        self.seq_lens[:b].copy_(torch.where(active[:, 0], lengths + k, w).to(torch.int32))

    def _meta(self, b: int) -> AttentionMetadata:
        w = self.width
        if self.device.type == "cuda":  # captured: host sizes are bounds, as in the uniform graphs
            seq_lens_cpu, max_len = [self.max_model_len] * b, self.max_model_len
        else:
            seq_lens_cpu = self.seq_lens[:b].tolist()
            max_len = max(seq_lens_cpu)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b * w], query_start_loc=self.query_start[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=w,
            max_seq_len=max_len, num_decodes=0, query_start_loc_cpu=list(range(0, (b + 1) * w, w)),
            seq_lens_cpu=seq_lens_cpu)

    def _targets(self, b: int, logits: torch.Tensor, sampled: bool) -> torch.Tensor:
        """Each row's token to compare with its draft [B, W]: the argmax for greedy slots. For a
        sampled slot (speculative sampling with point-mass drafts, layers/rejection.py): row j's
        draft d_j where a uniform u_j < p_j(d_j) (accepted), else a draw from p_j without d_j
        (the residual); rows past the drafts draw from p_j itself (the bonus token). The first
        row that disagrees with its draft is then the first rejection, and its target is the
        token emitted there: the accept step needs nothing else."""
        w = self.width
        rows = logits.view(b, w, -1)
        target = rows.argmax(dim=-1)
        if not sampled:
            return target
        inv_temp = self.inv_temp[:b]
        probs = torch.softmax(rows * inv_temp[:, None, None], dim=-1)
        drafts = torch.cat([self.drafts[:b], self.drafts.new_zeros(b, 1)], dim=1)
        has = self.cols_w[None, :] < self.num_drafts[:b, None]
        p_draft = probs.gather(2, drafts[..., None]).squeeze(2)
        accepted = has & accept_drafts(torch.rand_like(p_draft), p_draft)
        drawn = sample_from_probs(point_mass_residual_(probs, drafts, p_draft, has), [])
        return torch.where((inv_temp > 0)[:, None], torch.where(accepted, drafts, drawn), target)

    def _accept(self, b: int, logits: torch.Tensor, sampled: bool = False) -> None:
        target = self._targets(b, logits, sampled)
        if self.device.type == "cuda":
            from rooflm.kernels.spec_loop_step import accept_step
            accept_step(self, b, target)
        else:
            self._accept_torch(b, target)

    def _accept_torch(self, b: int, target: torch.Tensor) -> None:
        """Step 4 in torch ops, from _targets' [B, W]: the CPU path, and the reference of
        kernels/spec_loop_step.py."""
        w, k = self.width, self.k
        drafts = self.drafts[:b]
        valid = self.cols_k[None, :] < self.num_drafts[:b, None]
        accepted = ((drafts == target[:, :k]) & valid).long().cumprod(dim=1).sum(dim=1)  # [B]
        final = target.gather(1, accepted[:, None])
        emitted = torch.where(self.cols_w[None, :] < accepted[:, None], torch.cat([drafts, final], 1), final)
        count = torch.where(self.live[:b], accepted + 1, 0)
        lengths = self.lengths[:b]
        index = (lengths[:, None] + self.cols_w[None, :]).clamp_max(self.hist.shape[1] - 1)
        hist = self.hist[:b]
        keep = self.cols_w[None, :] < count[:, None]
        hist.scatter_(1, index, torch.where(keep, emitted, hist.gather(1, index).long()).to(torch.int32))
        lengths += count
        pack = self.pack[:b]
        pack[:, :w] = emitted
        pack[:, w] = count
        pack[:, w + 1:w + 1 + k] = drafts
        pack[:, -1] = self.num_drafts[:b]

    def _body(self, b: int, sampled: bool) -> None:
        self._prepare(b)
        logits = self.runner.logits_of(self.input_ids[:b * self.width], self.positions[:b * self.width],
                                       self._meta(b))
        self._accept(b, logits, sampled)

    @torch.inference_mode()
    def capture(self, sizes: list[int], pool) -> None:
        """One CUDA graph per batch size, every slot empty (no K/V written, no history changed)."""
        self.active.zero_()
        self.lengths.zero_()
        for size in sorted({s for s in sizes if s <= self.max_batch}, reverse=True):
            for sampled in (False, True) if size <= MAX_SAMPLED_BATCH else (False,):
                for _ in range(2):  # warm-up: compile outside the capture
                    self._body(size, sampled)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._body(size, sampled)
                pool = pool if pool is not None else graph.pool()
                self.graphs[(size, sampled)] = graph
        torch.cuda.synchronize()

    # ---- the host side ---------------------------------------------------------------------

    @property
    def active_loop(self) -> bool:
        return bool(self.slots)

    def _graph_size(self, batch: int, sampled: bool = False) -> Optional[int]:
        if sampled and batch > MAX_SAMPLED_BATCH:
            return None
        if self.device.type != "cuda":
            return batch
        return min((s for s, with_draws in self.graphs if s >= batch and with_draws == sampled), default=None)

    def wants(self, scheduler: Scheduler, k: int, proposer) -> bool:
        """Whether the running batch could enter the loop (before the engine drains a step)."""
        running = scheduler.running_requests()
        if k != self.k or not running or scheduler.has_waiting_or_swapped():
            return False
        if len(running) > self.max_batch:
            return False
        if proposer.device_proposer() is None:
            return False
        # The look-ahead of two steps a sequence must fit beside what the pool holds.
        if scheduler.num_free_blocks < len(running) * (2 * self.width // self.block_size + 2):
            return False
        modes = [loop_sampling(req) for req in running]
        if None in modes or self._graph_size(len(running), "temperature" in modes) is None:
            return False
        return all(self._has_room(req, req.seqs[0]) for req in running)

    def _has_room(self, req: Request, seq: Sequence) -> bool:
        """Whether a step launched now is of use and fits: the step in flight (up to W tokens)
        cannot end the sequence at max_tokens (the device stops a slot exactly there), and both
        steps' K/V fit the context."""
        return (req.max_tokens - seq.num_output_tokens - seq.num_pending > self.width
                and self.max_model_len - seq.num_tokens >= 2 * self.width)

    def enter(self, scheduler: Scheduler, proposer) -> bool:
        """Take the running sequences into the slots (nothing may be in flight)."""
        seqs = [(req, req.seqs[0]) for req in scheduler.running_requests()]
        if not all(seq.num_pending == 0 and seq.num_uncomputed_tokens == 1 for _, seq in seqs):
            return False
        device_proposer = proposer.device_proposer()
        if device_proposer is None:
            return False
        modes = [loop_sampling(req) for req, _ in seqs]
        if None in modes:
            return False
        self.sampled = "temperature" in modes
        self.size = self._graph_size(len(seqs), self.sampled)
        if self.size is None:
            return False
        device_proposer.begin(seqs, self.max_batch, self.device)
        self.proposer = device_proposer
        n = len(seqs)
        host = torch.zeros(n, max(len(seq.token_ids) for _, seq in seqs), dtype=torch.int32)
        for b, (_, seq) in enumerate(seqs):
            host[b, :len(seq.token_ids)] = torch.tensor(seq.token_ids, dtype=torch.int32)
        self.hist[:n, :host.shape[1]].copy_(host)
        lengths = torch.zeros(self.max_batch, dtype=torch.int64)
        lengths[:n] = torch.tensor([len(seq.token_ids) for _, seq in seqs])
        self.lengths.copy_(lengths)
        inv_temp = torch.zeros(self.max_batch, dtype=torch.float32)
        inv_temp[:n] = torch.tensor([0.0 if req.params.greedy else 1.0 / req.params.temperature for req, _ in seqs])
        self.inv_temp.copy_(inv_temp)
        limit = torch.zeros(self.max_batch, dtype=torch.int64)
        limit[:n] = torch.tensor([min(req.num_prompt_tokens + req.max_tokens, self.max_model_len) for req, _ in seqs])
        self.limit.copy_(limit)
        self.active.copy_(torch.arange(self.max_batch) < n)
        self.slots = seqs
        self._versions = [-1] * n
        for _, seq in seqs:
            seq.num_lookahead_tokens = 2 * self.width + 1
        self.num_entries += 1
        return True

    def can_continue(self, scheduler: Scheduler, k: int) -> bool:
        if k != self.k or scheduler.has_waiting_or_swapped():
            return False
        return all(req.status == RequestStatus.RUNNING and seq.finish_reason is None
                   and self._has_room(req, seq) for req, seq in self.slots)

    def _grow_tables(self, scheduler: Scheduler, keep: list) -> bool:
        """Blocks for two more steps of every slot, and their device rows where tables changed."""
        copies: list[tuple[int, int]] = []
        for b, (_, seq) in enumerate(self.slots):
            table = seq.block_table
            if not scheduler.grow_ahead(seq, seq.num_tokens + 2 * self.width, copies):
                return False
            if table.version != self._versions[b]:
                row = torch.tensor(table.ids, dtype=torch.int32)
                if self.device.type == "cuda":
                    row = row.pin_memory()
                    keep.append(row)
                self.block_tables[b, :len(table.ids)].copy_(row, non_blocking=True)
                self._versions[b] = table.version
        if copies:  # copy-on-write of a shared block, queued before the step that writes it
            self.runner.apply_block_ops(SchedulerOutput(blocks_to_copy=copies))
        return True

    @torch.inference_mode()
    def launch(self, scheduler: Scheduler) -> Optional[LoopStep]:
        """Queue the next step (None: the pool is short; the engine leaves the loop)."""
        keep: list = []
        if not self._grow_tables(scheduler, keep):
            return None
        size = self.size
        self.num_steps += 1
        self.proposer.propose(self.hist, self.lengths, self.drafts, self.num_drafts, size)
        graph = self.graphs.get((size, self.sampled))
        if graph is not None:
            graph.replay()
        else:
            self._body(size, self.sampled)
        out = SchedulerOutput(scheduled=[ScheduledSeq(req, seq, self.width, -1, True, num_spec_slots=self.k)
                                         for req, seq in self.slots])
        ready = None
        if self.device.type == "cuda":
            host = torch.empty((size, self.pack.shape[1]), dtype=torch.int64, pin_memory=True)
            host.copy_(self.pack[:size], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = self.pack[:size].clone()
        return LoopStep(out, host, ready, "full" if graph is not None else "eager", keep)

    def collect(self, step: LoopStep) -> dict[int, list[int]]:
        """Wait for a step and describe it as a scheduled verify step would have been: start,
        drafts and the counters' moves (Scheduler.schedule's), then its tokens by seq_id."""
        if step.ready is not None:
            step.ready.synchronize()
        rows = step.host.tolist()
        w = self.width
        sampled = {}
        for row, sch in zip(rows, step.out.scheduled):
            seq = sch.seq
            if seq.finish_reason is not None:
                continue
            drafts = row[w + 1:w + 1 + row[-1]]
            sch.start = seq.num_computed_tokens
            sch.num_new_tokens = 1 + len(drafts)
            sch.spec_token_ids = drafts
            seq.num_computed_tokens += sch.num_new_tokens
            seq.num_pending += 1
            sampled[seq.seq_id] = row[:row[w]]
        return sampled

    def release_lookahead(self) -> None:
        """No step will follow the one in flight: its rollback may give back every spare block."""
        for _, seq in self.slots:
            seq.num_lookahead_tokens = 0

    def exit(self, scheduler: Scheduler) -> None:
        """Leave the loop with nothing in flight: spare blocks go back, the slots empty."""
        for req, seq in self.slots:
            seq.num_lookahead_tokens = 0
            if not seq.finished and req.status == RequestStatus.RUNNING:
                scheduler.rollback_spec(seq)
        self.active.zero_()  # queued behind the last step: later replays write nothing
        self.slots = []
        self.proposer = None
