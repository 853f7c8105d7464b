"""Iteration-level scheduling: which tokens of which sequences run in the next step.

One rule serves prefill, chunked prefill, prefix hits and decode: a sequence
is scheduled for the tokens between num_computed_tokens and num_tokens, as
many as the step's token budget allows. Each step:
  1. running requests, oldest first, get their next tokens; when the KV pool
     is short, the most recently admitted request is preempted whole
     (recompute: drop its blocks and requeue it at the front; swap: move its
     blocks to host memory);
  2. if nothing was preempted, swapped-out requests come back, oldest first;
  3. then waiting requests are admitted first-come first-served, each after a
     prefix-cache lookup, until the budget, the sequence cap or the pool runs out.
The output is a plain description of the batch; the model runner makes tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rooflm.config import SchedulerConfig
from rooflm.engine.block_manager import BlockManager
from rooflm.engine.request import Request, RequestStatus, Sequence


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int
    start: int  # num_computed_tokens when scheduled: the position of the first new token
    completes: bool  # after this step the K/V is complete, so the sequence samples a token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0

    # ---- queue management ----------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running)

    def free_seq(self, req: Request, seq: Sequence) -> None:
        if req.status == RequestStatus.SWAPPED:
            self.bm.free_host([seq.block_table])
        else:
            self.bm.free(seq.block_table)

    def finish(self, req: Request) -> None:
        """Remove a request whose sequences are all finished (or aborted); free every block."""
        for seq in req.seqs:
            if seq.block_table:
                self.free_seq(req, seq)
        for queue in (self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.status = RequestStatus.FINISHED

    # ---- the step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
        # The counters move now, not when the results arrive, so that the next step can be
        # scheduled while this one still runs: a sampling sequence gains a pending token.
        for sch in out.scheduled:
            sch.seq.num_computed_tokens += sch.num_new_tokens
            if sch.completes:
                sch.seq.num_pending += 1
        return out

    @staticmethod
    def _schedulable(req: Request, seq: Sequence) -> bool:
        if seq.num_uncomputed_tokens <= 0:
            return False
        if seq.num_pending:
            # Only the pending token is left to compute; its id will come from the device.
            # A sequence that already has all its tokens is about to finish: skip it.
            return (seq.num_pending == 1 and seq.num_computed_tokens == seq.num_known_tokens
                    and seq.num_output_tokens + seq.num_pending < req.max_tokens)
        return True

    def _plan(self, req: Request, budget: int) -> list[tuple[Sequence, int]] | None:
        """Tokens for each live sequence of a group, at least one each, or None."""
        live = req.live_seqs
        if req.needs_host_tokens and any(s.num_pending for s in live):
            return None  # the group waits a step for its tokens to reach the host
        seqs = [s for s in live if self._schedulable(req, s)]
        if not seqs or budget < len(seqs):
            return None
        plan = []
        for i, seq in enumerate(seqs):
            reserve = len(seqs) - i - 1  # keep one token for each sequence still to plan
            n = min(seq.num_uncomputed_tokens, budget - reserve)
            plan.append((seq, n))
            budget -= n
        return plan

    def _blocks_for(self, plan: list[tuple[Sequence, int]]) -> int:
        return sum(self.bm.slots_needed(s.block_table, s.num_computed_tokens + n)
                   + self.bm.cow_needed(s.block_table, s.num_computed_tokens) for s, n in plan)

    def _commit(self, req: Request, plan, out: SchedulerOutput) -> int:
        used = 0
        for seq, n in plan:
            start = seq.num_computed_tokens
            ok = self.bm.allocate_slots(seq.block_table, start, start + n, out.blocks_to_copy)
            assert ok, "allocation was checked for the whole group"
            out.scheduled.append(ScheduledSeq(req, seq, n, start, start + n == seq.num_tokens))
            used += n
        return used

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)
        kept: list[Request] = []
        while queue:
            req = queue.pop(0)
            plan = self._plan(req, budget)
            if plan is None:
                kept.append(req)  # no budget left this step; it stays running
                continue
            while self._blocks_for(plan) > self.bm.num_free_blocks:
                victim = queue.pop() if queue else req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                budget -= self._commit(req, plan, out)
                kept.append(req)
        self.running = kept
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        req.num_preemptions += 1
        out.preempted.append(req)
        tables = [s.block_table for s in req.live_seqs]
        if (self.cfg.preemption_mode == "swap"
                and self.bm.can_swap_out(self.bm.num_unique_blocks(tables))):
            out.blocks_to_swap_out.extend(self.bm.swap_out(tables))
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            return
        for seq in req.live_seqs:
            self.bm.free(seq.block_table)
            seq.num_computed_tokens = 0
            seq.num_cached_blocks = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _has_seq_room(self, req: Request) -> bool:
        return self.num_running_seqs() + len(req.live_seqs) <= self.cfg.max_num_seqs

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped:
            req = self.swapped[0]
            if any(s.num_pending for s in req.live_seqs):
                break  # its last tokens are still on their way to the host
            tables = [s.block_table for s in req.live_seqs]
            plan = self._plan(req, budget)
            if plan is None or not self._has_seq_room(req):
                break
            growth = sum(self.bm.blocks_needed(s.num_computed_tokens + n) - len(s.block_table) + 1
                         for s, n in plan)
            if self.bm.num_unique_blocks(tables) + growth > self.bm.num_free_blocks:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.bm.swap_in(tables))
            for seq in req.live_seqs:
                seq.num_cached_blocks = 0  # fresh device blocks: register them again
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= self._commit(req, plan, out)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if not self._has_seq_room(req) or any(s.num_pending for s in req.live_seqs):
                break  # FCFS: a preempted request waits for its pending tokens, and blocks the queue
            hits = {id(s): self.bm.find_cached_prefix(s.token_ids, req.cache_salt)
                    if s.num_computed_tokens == 0 else [] for s in req.live_seqs}
            plan = self._plan_admission(req, hits, budget)
            if plan is None:
                break
            need = sum(self.bm.blocks_needed(h * self.bm.block_size + n) - h for (_, n), h in
                       ((p, len(hits[id(p[0])])) for p in plan))
            all_hits = [b for s in req.live_seqs for b in hits[id(s)]]
            if not self.bm.can_allocate(need, all_hits):
                break
            self.waiting.popleft()
            for seq in req.live_seqs:
                if seq.num_computed_tokens == 0:
                    self.bm.record_prefix_query(seq.num_tokens, len(hits[id(seq)]) * self.bm.block_size)
                if hits[id(seq)]:
                    self.bm.take_cached_prefix(seq.block_table, hits[id(seq)])
                    seq.num_computed_tokens = len(hits[id(seq)]) * self.bm.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = max(len(h) for h in hits.values()) * self.bm.block_size
                req.scheduled_time = time.monotonic()  # end of its queue time
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= self._commit(req, plan, out)

    def _plan_admission(self, req: Request, hits: dict, budget: int):
        plan = []
        seqs = req.live_seqs
        for i, seq in enumerate(seqs):
            cached = len(hits[id(seq)]) * self.bm.block_size
            remaining = seq.num_tokens - max(cached, seq.num_computed_tokens)
            reserve = len(seqs) - i - 1
            n = min(remaining, budget - reserve)
            if n < 1 or (n < remaining and not self.cfg.enable_chunked_prefill):
                return None
            plan.append((seq, n))
            budget -= n
        return plan
