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
     prefix-cache lookup, until the budget, the sequence cap or the pool runs out;
     the pool keeps back room for the running requests' expected growth
     (growth_reserve.py), so that admission does not buy preemptions later.
Whether a request fits is one rule for all three (_blocks_needed): the blocks it
takes back onto the device (a swap-in, prefix hits in the free queue) plus each
table's growth (BlockManager.blocks_to_grow). The output is a plain description
of the batch; the model runner makes tensors.

Under --scheduling-policy priority (vLLM's semantics) every queue is kept in
order of (priority, arrival time), lower first: waiting requests are admitted
in that order, the running ones are served in it (so the preemption victim of
step 1, taken from the back, is the lowest-priority, latest-arrived one), and
before step 1 a waiting request that the KV pool or the sequence cap cannot take
preempts running requests of lower priority, lowest first, until it fits
(_preempt_for_priority). Two extensions of vLLM's rules keep a high-priority arrival
from waiting steps under load: running requests get only the budget that the prompts of
waiting requests of a higher priority leave (their chunks shrink first, their decodes wait
only in a burst: _Outranking), and a swapped-out request does not come back before a
waiting one that outranks it.
Under fcfs (the default) the queues keep arrival order, as described above.

Block tables are the block manager's; the engine's output processor changes
them only through this class (fork_seq, cache_computed_blocks, free_seq, finish).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from rooflm.config import SchedulerConfig
from rooflm.engine.block_manager import NO_HIT, BlockManager, PrefixHit
from rooflm.engine.growth_reserve import NewTokenRatio, remaining_tokens
from rooflm.engine.request import Request, RequestStatus, Sequence


def _schedule_key(req: Request) -> tuple[int, float]:
    return req.schedule_key


@dataclass(slots=True)  # hundreds made and read every step
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int
    start: int  # num_computed_tokens when scheduled: the position of the first new token
    completes: bool  # after this step the K/V is complete, so the sequence samples a token
    # Speculative decoding: the draft tokens verified after the sequence's last token, filled
    # in by the proposer once the step is scheduled (num_new_tokens = 1 + their number).
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_slots: int = 0  # draft slots allocated; the proposer fills at most this many


@dataclass(slots=True)
class _Planned:
    """A sequence's share of the step, before its blocks are allocated."""

    seq: Sequence
    start: int  # position of the first new token: after the computed ones, or the prefix hit
    num_new_tokens: int
    hit: PrefixHit = NO_HIT  # a waiting sequence's cached prefix, taken on admission
    num_spec: int = 0  # draft slots after the sequence's last token (speculative decoding)


class _Outranking:
    """Under the priority policy, the step's token budget that waiting requests hold against
    running ones they outrank: a running request of a larger (priority, arrival) key gets only
    the budget that the prompts of the waiting requests of smaller keys leave. Its prompt's next
    chunk shrinks first; its decode token waits only when those prompts would not fit beside it
    (a burst of high-priority arrivals). Without this, the chunks of low-priority prompts
    admitted in earlier steps, then the low-priority decodes, took the budget before admission
    ran, and a high-priority arrival waited a step or more behind them (simulated at 1.5x
    overload, Llama-3-8B on the H200 calibration, 20% high priority: high-priority P99 TTFT
    146 -> 119 ms at a budget of 1024 tokens, 204 -> 190 ms at 2048, at equal throughput;
    66 ms unloaded). The running requests are asked in key order, so one pass over the waiting
    queue (in key order too) serves the whole step."""

    __slots__ = ("_waiting", "_next", "_held", "_seq_room")

    def __init__(self, waiting: deque, seq_room: int):
        self._waiting = waiting
        self._next = 0
        self._held = 0  # uncomputed prompt tokens of the waiting requests passed so far
        self._seq_room = seq_room  # sequence slots left: a request beyond them holds nothing

    def budget_for(self, req: Request, budget: int) -> int:
        if self._next < len(self._waiting) and self._held < budget:
            self._pass(req.schedule_key, budget)
        return budget - min(self._held, budget)

    def _pass(self, key: tuple[int, float], budget: int) -> None:
        """Count the waiting requests of smaller keys than `key`, up to the budget."""
        while self._next < len(self._waiting) and self._held < budget:
            ahead = self._waiting[self._next]
            if ahead.schedule_key >= key:
                break
            self._next += 1
            seqs = ahead.live_seqs
            if ahead.waiting_for_grammar or any(s.num_pending for s in seqs) or len(seqs) > self._seq_room:
                continue  # it cannot be admitted this step: it holds nothing
            self._seq_room -= len(seqs)
            # Prefix hits are not looked up here (hashing): a cached prompt holds more than it uses.
            self._held += sum(s.num_uncomputed_tokens for s in seqs)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Request] = field(default_factory=list)
    spec: object = None  # the proposer's device data for verification (spec.decoder.SpecBatch)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: the engine does not launch the step, so its block ops would never
        execute. The scheduler carries an empty step's swap-outs into the next step."""
        return not self.scheduled


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager):
        if cfg.max_num_seqs is None:
            raise ValueError("Scheduler needs a resolved max_num_seqs (config.with_device_defaults)")
        self.cfg = cfg
        self.bm = block_manager
        self.by_priority = cfg.scheduling_policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.num_schedules = 0  # calls of schedule(): when what it decided may have changed
        self.new_token_ratio = NewTokenRatio()
        self.num_kv_stalls = 0  # steps whose admission stopped for lack of KV room
        # The last step's admission stopped for lack of KV or sequence room (not budget): the
        # queue then advances only as running requests finish (step_cost.predict_queue_wait).
        self.capacity_blocked = False
        self._seqs_running = 0  # live sequences of running groups, while a step is scheduled
        # Swap-outs of a step that ran nothing, for the next step that runs. Until then the
        # device blocks they copy from are not written: only a launched step writes K/V.
        self._unsent_swap_outs: list[tuple[int, int]] = []
        # --enable-lora: the most distinct adapters the running requests may use (the device's
        # slots, --max-loras); 0: no LoRA.
        self.max_loras = 0
        # Pipeline parallelism with batches in flight: a sequence whose sampled token has not
        # reached the host waits for it (as a request that needs host tokens does), so each
        # batch in flight holds requests the others do not (vLLM's virtual engines).
        self.hold_pending = False
        # Batches in flight (PipelineStep): each step takes at most 1 / micro_batches of the
        # sequences that could run, so that the next batches have requests of their own.
        self.micro_batches = 1
        self._step_cap: Optional[int] = None

    def use_micro_batches(self, depth: int) -> None:
        """Schedule for pipeline parallelism with `depth` batches in flight."""
        self.micro_batches = depth
        self.hold_pending = depth > 1

    # ---- queue management ----------------------------------------------------------------

    def add(self, req: Request) -> None:
        for seq in req.seqs:
            if seq.block_table is None:
                seq.block_table = self.bm.new_table()
        self._enqueue(self.waiting, req)

    def _enqueue(self, queue: deque, req: Request, front: bool = False) -> None:
        """FCFS: at the back, or (a preempted request) at the front. Priority: in order of
        (priority, arrival), after any equal key."""
        if self.by_priority:
            queue.insert(bisect.bisect_right(queue, req.schedule_key, key=_schedule_key), req)
        elif front:
            queue.appendleft(req)
        else:
            queue.append(req)

    def _start_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if self.by_priority:
            bisect.insort_right(self.running, req, key=_schedule_key)
        else:
            self.running.append(req)
        self._seqs_running += len(req.live_seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        count = 0
        for r in self.running:
            # Most groups hold one sequence: no list of live ones to build (batch 256, every step).
            count += (r.seqs[0].finish_reason is None) if len(r.seqs) == 1 else len(r.live_seqs)
        return count

    def free_seq(self, seq: Sequence) -> None:
        """A finished sequence gives its blocks back at once, on the device or the host."""
        self.bm.free(seq.block_table)

    def finish(self, req: Request) -> None:
        """Remove a request whose sequences are all finished (or aborted); free every block."""
        for seq in req.seqs:
            if seq.block_table:
                self.free_seq(seq)
            if seq.finish_reason in ("stop", "length"):
                self.new_token_ratio.observe_finished(seq.num_output_tokens, req.max_tokens)
        for queue in (self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.status = RequestStatus.FINISHED

    # ---- block bookkeeping after a step ------------------------------------------------------

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """A new sample of a request starts where its parent is, sharing its blocks."""
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_table = self.bm.fork(parent.block_table)

    def cache_computed_blocks(self, req: Request, seq: Sequence) -> None:
        """Register a sequence's newly full blocks in the prefix cache. Only blocks whose K/V
        is computed and whose token ids are all on the host can be hashed, and only blocks
        on the device are worth finding."""
        table = seq.block_table
        if req.status != RequestStatus.RUNNING or table is None or not table.ids:
            return
        known = min(seq.num_computed_tokens, len(seq.token_ids))
        if known // self.bm.block_size <= table.num_cached_blocks:
            return  # no block filled up since the last call: most decode steps of most sequences
        self.bm.cache_full_blocks(table, seq.token_ids, known, req.cache_salt, req.lora_key)

    # ---- speculative decoding ------------------------------------------------------------
    # What rooflm/spec/ reads and changes between steps; it never touches the queues.

    def running_requests(self) -> list[Request]:
        """The running requests, oldest first: the live list (read it, never change it)."""
        return self.running

    def has_waiting_or_swapped(self) -> bool:
        """Whether a request waits for admission or is swapped out (the next step may change
        the running batch)."""
        return bool(self.waiting or self.swapped)

    def decoding_seqs(self) -> list[tuple[Request, Sequence]]:
        """The running sequences with one token left to compute, oldest request first: those
        whose next step can verify drafts."""
        return [(req, seq) for req in self.running for seq in req.live_seqs if seq.num_uncomputed_tokens == 1]

    def clear_spec_slots(self) -> None:
        """No running or swapped-out sequence keeps draft slots for the next step."""
        for queue in (self.running, self.swapped):
            for req in queue:
                for seq in req.live_seqs:
                    seq.num_spec_slots = 0

    def shrink_spec(self, sch: ScheduledSeq, num_drafts: int) -> None:
        """The proposer filled fewer draft slots than were scheduled: the step computes fewer
        tokens (blocks allocated for the unused slots go back at rollback_spec)."""
        unused = sch.num_spec_slots - num_drafts
        sch.num_new_tokens -= unused
        sch.seq.num_computed_tokens -= unused
        sch.num_spec_slots = num_drafts

    def rollback_spec(self, seq: Sequence) -> None:
        """After a verify step: the K/V of rejected drafts is not the sequence's. Only the
        tokens before the last appended one count as computed (the last one's K/V is computed
        next step), and blocks past them are freed."""
        if seq.finished or seq.block_table is None:
            return
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_known_tokens - 1)
        self.bm.trim(seq.block_table, seq.num_computed_tokens + seq.num_lookahead_tokens)

    def grow_ahead(self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Blocks for a running sequence's first num_tokens tokens, ahead of scheduling (the
        device loop, spec/loop.py, writes K/V steps before the host counts them); copy-on-write
        copies go to `copies`. False, changing nothing, when the pool is short. Blocks it evicts
        from the prefix cache are not offloaded to the host tier: the loop writes them before a
        step could copy them out."""
        ok = self.bm.allocate(seq.block_table, seq.num_computed_tokens, num_tokens, copies)
        self.bm.discard_offloads()
        return ok

    @property
    def num_free_blocks(self) -> int:
        return self.bm.num_free_blocks

    # ---- the step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.num_schedules += 1
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        if self.by_priority and self.waiting and self.running:
            self._preempt_for_priority(out)
        num_for_priority = len(out.preempted)
        self._step_cap = self._micro_batch_cap()
        budget = self._schedule_running(out, budget)
        ran_short = len(out.preempted) > num_for_priority  # the running requests outgrew the pool
        self._update_ratio(ran_short)
        if not ran_short:
            # Counted once here, then kept up to date as groups join: not once per admission.
            self._seqs_running = self.num_running_seqs()
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
        # The counters move now, not when the results arrive, so that the next step can be
        # scheduled while this one still runs: a sampling sequence gains a pending token.
        for sch in out.scheduled:
            sch.seq.num_computed_tokens += sch.num_new_tokens
            if sch.completes:
                sch.seq.num_pending += 1
        # The host tier's copies (block_manager.take_block_ops): offloads of evicted blocks
        # run with the swap-outs, before any block is written; restores with the swap-ins.
        offloads, restores = self.bm.take_block_ops()
        out.blocks_to_swap_out.extend(offloads)
        out.blocks_to_swap_in.extend(restores)
        self._carry_swap_outs(out)
        return out

    def _micro_batch_cap(self) -> Optional[int]:
        """Sequences one step may take with batches in flight: an even share of those running and
        of the queues (at most max_num_seqs of them), or None without micro-batches."""
        if self.micro_batches == 1:
            return None
        total = min(self.cfg.max_num_seqs, self.num_running_seqs() + len(self.waiting) + len(self.swapped))
        return max(1, -(-total // self.micro_batches))

    def _full(self, out: SchedulerOutput) -> bool:
        return self._step_cap is not None and len(out.scheduled) >= self._step_cap

    def _carry_swap_outs(self, out: SchedulerOutput) -> None:
        """A step can preempt by swapping and then schedule nothing (its requests wait for
        tokens, or the only running request preempted itself). Its swap-outs go first in the
        next step that runs, before any block they free is written again."""
        if out.is_empty:
            self._unsent_swap_outs.extend(out.blocks_to_swap_out)
            out.blocks_to_swap_out = []
        elif self._unsent_swap_outs:
            out.blocks_to_swap_out[:0] = self._unsent_swap_outs
            self._unsent_swap_outs = []

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

    def _plan(self, req: Request, budget: int) -> list[_Planned] | None:
        """Tokens for each live sequence of a running or swapped-out group, at least one
        each, or None."""
        if len(req.seqs) == 1:
            return self._plan_one(req, req.seqs[0], budget)
        live = req.live_seqs
        if (req.needs_host_tokens or self.hold_pending) and any(s.num_pending for s in live):
            return None  # the group waits a step for its tokens to reach the host
        seqs = [s for s in live if self._schedulable(req, s)]
        if not seqs or budget < len(seqs):
            return None
        plan = []
        for i, seq in enumerate(seqs):
            reserve = len(seqs) - i - 1  # keep one token for each sequence still to plan
            n = min(seq.num_uncomputed_tokens, budget - reserve)
            spec = self._spec_slots(seq, budget - reserve - n)
            plan.append(_Planned(seq, seq.num_computed_tokens, n + spec, num_spec=spec))
            budget -= n + spec
        return plan

    def _plan_one(self, req: Request, seq: Sequence, budget: int) -> list[_Planned] | None:
        """_plan for a group of one sequence (n = 1, or before the fork): the common case,
        run for every running request every step, so without the group's lists."""
        if seq.finished or budget < 1 or (seq.num_pending and (req.needs_host_tokens or self.hold_pending)):
            return None
        if not self._schedulable(req, seq):
            return None
        n = min(seq.num_uncomputed_tokens, budget)
        spec = self._spec_slots(seq, budget - n)
        return [_Planned(seq, seq.num_computed_tokens, n + spec, num_spec=spec)]

    @staticmethod
    def _spec_slots(seq: Sequence, budget: int) -> int:
        """Draft slots a decoding sequence gets after its last token, within the budget: the
        tokens to verify count like any others (the one-counter rule)."""
        if not seq.num_spec_slots or seq.num_uncomputed_tokens != 1 or seq.num_pending:
            return 0
        return max(0, min(seq.num_spec_slots, budget))

    @staticmethod
    def _without_drafts(plan: list[_Planned]) -> list[_Planned] | None:
        """The plan with its draft slots dropped, or None if it had none: drafts are the
        first thing to give up when the pool is short, before anyone is preempted."""
        if not any(p.num_spec for p in plan):
            return None
        return [_Planned(p.seq, p.start, p.num_new_tokens - p.num_spec, p.hit) for p in plan]

    def _plan_admission(self, req: Request, hits: list[PrefixHit], budget: int) -> list[_Planned] | None:
        """Tokens for every live sequence of a waiting group after its prefix hits, or None
        when one would get none (or only part of its prompt, without chunked prefill)."""
        plan = []
        seqs = req.live_seqs
        for i, (seq, hit) in enumerate(zip(seqs, hits)):
            start = max(hit.num_tokens, seq.num_computed_tokens)
            remaining = seq.num_tokens - start
            reserve = len(seqs) - i - 1
            n = min(remaining, budget - reserve)
            if n < 1 or (n < remaining and not self.cfg.enable_chunked_prefill):
                return None
            plan.append(_Planned(seq, start, n, hit))
            budget -= n
        return plan

    def _blocks_needed(self, req: Request, plan: list[_Planned]) -> int:
        """Free device blocks that scheduling `plan` takes, for running, swapped-out and
        waiting requests alike: the blocks the group takes back onto the device, then the
        growth of each planned table."""
        need = 0
        if req.status != RequestStatus.RUNNING:  # a running request's blocks are all on the device
            tables = [s.block_table for s in req.live_seqs]
            need = self.bm.blocks_to_admit(tables, [p.hit for p in plan])
        for p in plan:
            need += self.bm.blocks_to_grow(p.seq.block_table, p.start, p.start + p.num_new_tokens, p.hit)
        return need

    def _fits(self, req: Request, plan: list[_Planned]) -> bool:
        return self._blocks_needed(req, plan) <= self.bm.num_free_blocks

    def _commit(self, req: Request, plan: list[_Planned], out: SchedulerOutput) -> int:
        used = 0
        for p in plan:
            seq, n = p.seq, p.num_new_tokens
            start = seq.num_computed_tokens
            ok = self.bm.allocate(seq.block_table, start, start + n, out.blocks_to_copy)
            assert ok, "allocation was checked for the whole group"
            completes = start + n - p.num_spec == seq.num_tokens
            out.scheduled.append(ScheduledSeq(req, seq, n, start, completes, num_spec_slots=p.num_spec))
            used += n
        return used

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = deque(self.running)  # oldest first; victims leave from the back
        kept: list[Request] = []
        outranking = None
        if self.by_priority and self.waiting and self.running:
            # Both queues are in key order: unless the best waiting key is below the worst running
            # one, nobody is outranked (the usual case) and the step pays nothing for the rule.
            if self.waiting[0].schedule_key < self.running[-1].schedule_key:
                outranking = _Outranking(self.waiting, self.cfg.max_num_seqs - self.num_running_seqs())
        while queue:
            req = queue.popleft()
            if self._full(out):
                kept.append(req)  # the next batch in flight takes it
                continue
            own = budget if outranking is None else outranking.budget_for(req, budget)
            if self._schedule_plain_decode(req, own, out):
                budget -= 1
                kept.append(req)
                continue
            plan = self._plan(req, own)
            if plan is None:
                kept.append(req)  # no budget left this step; it stays running
                continue
            while not self._fits(req, plan):
                bare = self._without_drafts(plan)
                if bare is not None:
                    plan = bare
                    continue
                victim = queue.pop() if queue else req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                budget -= self._commit(req, plan, out)
                kept.append(req)
        self.running = kept
        return budget

    def _schedule_plain_decode(self, req: Request, budget: int, out: SchedulerOutput) -> bool:
        """The step of most running requests at a large batch: one sequence, one new token,
        no draft slots, and room for it in the table's last block (no new block, no
        copy-on-write). Schedules it as _plan, _fits and _commit would, without their lists
        and growth arithmetic (they were most of the scheduler's time at batch 256); False
        leaves the request to the general path, which decides everything else."""
        seqs = req.seqs
        if len(seqs) != 1 or budget < 1:
            return False
        seq = seqs[0]
        start = seq.num_computed_tokens
        if (seq.finish_reason is not None or seq.num_spec_slots
                or len(seq.token_ids) + seq.num_pending - start != 1):
            return False
        if seq.num_pending and (req.needs_host_tokens or self.hold_pending or not self._schedulable(req, seq)):
            return False
        ids = seq.block_table.ids
        block_size = self.bm.block_size
        if start >= len(ids) * block_size:
            return False  # the token opens a new block
        if start % block_size and self.bm.blocks[ids[start // block_size]].ref_cnt > 1:
            return False  # it lands in a shared block: copy-on-write
        out.scheduled.append(ScheduledSeq(req, seq, 1, start, True))
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        req.num_preemptions += 1
        out.preempted.append(req)
        tables = [s.block_table for s in req.live_seqs]
        if self.cfg.preemption_mode == "swap" and self.bm.can_swap_out(tables):
            out.blocks_to_swap_out.extend(self.bm.swap_out(tables))
            req.status = RequestStatus.SWAPPED
            self._enqueue(self.swapped, req)
            return
        for seq in req.live_seqs:
            self.bm.free(seq.block_table)
            seq.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self._enqueue(self.waiting, req, front=True)

    def _adapter_slot_free(self, req: Request) -> bool:
        """Whether the running requests' adapters leave room for req's (--max-loras)."""
        running = {r.lora_request for r in self.running} - {None}
        return req.lora_request in running or len(running) < self.max_loras

    def _has_seq_room(self, req: Request) -> bool:
        return self._seqs_running + len(req.live_seqs) <= self.cfg.max_num_seqs

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        first_waiting = self._first_admissible_waiting() if self.by_priority else None
        while self.swapped and not self._full(out):
            req = self.swapped[0]
            if first_waiting is not None and first_waiting.schedule_key < req.schedule_key:
                # Priority: a waiting request that outranks it goes first (else a victim swapped
                # out for it would come straight back into the room it left, before it).
                break
            if any(s.num_pending for s in req.live_seqs):
                break  # its last tokens are still on their way to the host
            if req.lora_request is not None and not self._adapter_slot_free(req):
                break  # its adapter would be one more than the device's slots (--max-loras)
            plan = self._plan(req, budget)
            if plan is None or not self._has_seq_room(req) or not self._fits(req, plan):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.bm.swap_in([s.block_table for s in req.live_seqs]))
            self._start_running(req)
            budget -= self._commit(req, plan, out)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        reserved = None  # blocks kept for the running requests' growth, counted once per step
        compiling: list[Request] = []
        self.capacity_blocked = False
        while self.waiting and budget > 0 and not self._full(out):
            req = self.waiting[0]
            if req.waiting_for_grammar:
                # Its grammar compiles on a worker thread: the requests behind it go first,
                # and it keeps its place at the front for the next step.
                compiling.append(self.waiting.popleft())
                continue
            if req.lora_request is not None and not self._adapter_slot_free(req):
                # Its adapter would be one more than the device's slots: it keeps its place while
                # the requests behind it (the base model, resident adapters) go first.
                compiling.append(self.waiting.popleft())
                continue
            if not self._has_seq_room(req):
                self.capacity_blocked = True
                break
            if any(s.num_pending for s in req.live_seqs):
                break  # FCFS: a preempted request waits for its pending tokens, and blocks the queue
            hits = [self._lookup_prefix(req, seq) for seq in req.live_seqs]
            plan = self._plan_admission(req, hits, budget)
            if plan is None:
                break
            need = self._blocks_needed(req, plan)
            if need > self.bm.num_free_blocks:
                self.num_kv_stalls += 1
                self.capacity_blocked = True
                break
            if self.cfg.reserve_new_tokens and self.running:
                # With nothing running the request is admitted if it fits at all: the
                # reservation must never keep the engine idle.
                if reserved is None:
                    reserved = self._growth_blocks(self.running)
                own = self._growth_blocks([req])
                if need + own + reserved > self.bm.num_free_blocks:
                    self.num_kv_stalls += 1
                    self.capacity_blocked = True
                    break
                reserved += own
            self.waiting.popleft()
            self._admit(req, plan)
            budget -= self._commit(req, plan, out)
        if self.by_priority:
            for req in compiling:
                self._enqueue(self.waiting, req)
        else:
            self.waiting.extendleft(reversed(compiling))

    # ---- priority preemption ---------------------------------------------------------------

    def _first_admissible_waiting(self) -> Optional[Request]:
        return next((r for r in self.waiting if not r.waiting_for_grammar), None)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """The waiting request that goes next, if the pool (less the growth reservation, as
        admission counts it) or the sequence cap cannot take it, preempts running requests
        of lower priority (a larger (priority, arrival)), the lowest first, until it fits. A
        request never preempts one of its own or a higher priority: equal priorities keep
        their arrival order, as vLLM's priority scheduler does."""
        head = self._first_admissible_waiting()
        if (head is None or any(s.num_pending for s in head.live_seqs)
                or self.running[-1].schedule_key <= head.schedule_key):
            return  # nobody runs at a lower priority: the common case costs one comparison
        running_seqs = self.num_running_seqs()
        # The blocks the running requests take this step come first (they are scheduled
        # before admission): what they take is not free for the head.
        growth_now = {id(r): self._blocks_to_finish_step(r) for r in self.running}
        taken = sum(growth_now.values())
        while True:
            budget = max(1, self.cfg.max_num_batched_tokens - running_seqs)  # decodes go first
            hits = [self._lookup_prefix(head, seq) for seq in head.live_seqs]
            plan = self._plan_admission(head, hits, budget)
            if plan is None:
                return  # it cannot start this step, whatever is preempted
            need = self._blocks_needed(head, plan) + taken
            if self.cfg.reserve_new_tokens and self.running:
                need += self._growth_blocks([head]) + self._growth_blocks(self.running)
            if need <= self.bm.num_free_blocks and running_seqs + len(head.live_seqs) <= self.cfg.max_num_seqs:
                return
            if not self.running or self.running[-1].schedule_key <= head.schedule_key:
                return
            victim = self.running.pop()  # the running list is in priority order: the lowest
            running_seqs -= len(victim.live_seqs)
            taken -= growth_now[id(victim)]
            self._preempt(victim, out)

    def _blocks_to_finish_step(self, req: Request) -> int:
        """Blocks a running request may take this step: each live sequence's growth to all
        its known tokens (a decode's next block; the rest of a chunked prompt, at most)."""
        return sum(self.bm.blocks_to_grow(s.block_table, s.num_computed_tokens, s.num_tokens)
                   for s in req.live_seqs if s.num_uncomputed_tokens > 0)

    # ---- growth reservation -------------------------------------------------------------

    def _growth_blocks(self, reqs: list[Request]) -> float:
        """Blocks the requests are expected to grow by: ratio x their remaining tokens."""
        tokens = 0
        for req in reqs:
            if req.needs_fork:  # one sequence now, n after its first sample
                tokens += req.params.n * remaining_tokens(req.max_tokens, 0)
                continue
            for seq in req.seqs:
                if not seq.finished:
                    tokens += remaining_tokens(req.max_tokens, seq.num_output_tokens + seq.num_pending)
        return tokens * self.new_token_ratio.value / self.bm.block_size

    def _update_ratio(self, ran_short: bool) -> None:
        if not ran_short:
            self.new_token_ratio.decay()
            return
        seqs = [(req, s) for req in self.running for s in req.live_seqs]
        generated = sum(s.num_output_tokens + s.num_pending for _, s in seqs)
        max_new = sum(remaining_tokens(req.max_tokens, 0) for req, _ in seqs)
        self.new_token_ratio.raise_after_preemption(generated, max_new, len(seqs))

    def _lookup_prefix(self, req: Request, seq: Sequence) -> PrefixHit:
        if seq.num_computed_tokens:
            return NO_HIT
        return self.bm.find_cached_prefix(seq.token_ids, req.cache_salt, req.lora_key)

    def _admit(self, req: Request, plan: list[_Planned]) -> None:
        """A waiting request starts running: its sequences take their prefix hits, counted
        as computed."""
        taken = []
        for p in plan:
            seq, hit = p.seq, p.hit
            if seq.num_computed_tokens == 0:
                self.bm.record_prefix_query(seq.num_tokens, hit.num_tokens, hit.num_host_tokens)
            if hit.block_ids:
                taken.append((seq.block_table, hit))
                seq.num_computed_tokens = hit.num_tokens
        if taken:  # together: host-tier hits take fresh blocks only after every hit is held
            self.bm.take_cached_prefixes(taken)
        if req.num_preemptions == 0:
            req.num_cached_tokens = max(p.hit.num_tokens for p in plan)
            req.scheduled_time = time.monotonic()  # end of its queue time
        self._start_running(req)
