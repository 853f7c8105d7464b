"""Output processing: a step's sampled tokens -> sequence state -> RequestOutputs.

For each sequence scheduled in the step, in order:
  1. prompt logprobs, if asked for, are decoded to text;
  2. its newly full blocks go into the prefix cache (through the scheduler);
  3. if it sampled: at a request's first sample with n > 1 it forks into n
     sequences that share the prompt's blocks (through the scheduler); each
     sample's token is appended, detokenized incrementally (UTF-8 safe), matched
     against stop strings across token boundaries, and checked for EOS, stop
     tokens, max_tokens and the context length. A finished sequence frees its
     blocks at once.
Then every request that got tokens yields a RequestOutput (cumulative text and
ids, this step's deltas); a request whose samples have all finished is removed
from the scheduler. Block tables are never touched here: the scheduler and the
block manager own them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterator, Optional

from rooflm.engine.outputs import CompletionOutput, Logprobs, RequestOutput, TokenLogprob
from rooflm.engine.request import Request, RequestStatus, Sequence
from rooflm.engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from rooflm.engine.model_runner import StepResult

logger = logging.getLogger(__name__)

# Per request, per sample index: the token ids and text this step added.
Deltas = dict[int, tuple[list[int], str]]


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: set[int], max_model_len: int,
                 seq_ids: Iterator[int]):
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # None for dummy weights: no text, only token ids
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._seq_ids = seq_ids
        self.num_generated_tokens = 0  # since start: every token appended to a sequence
        # skip_special_tokens -> {token id: its text alone}, shared by the detokenizers.
        self._token_texts: dict[bool, dict[int, str]] = {}

    # ---- sequences ------------------------------------------------------------------------

    def new_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), index, token_ids, len(req.prompt_token_ids))
        self._init_text_state(req, seq)
        return seq

    def _init_text_state(self, req: Request, seq: Sequence) -> None:
        from rooflm.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher
        if self.tokenizer is not None:
            skip = req.params.skip_special_tokens
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer.hf, req.prompt_token_ids, skip,
                                                     self._token_texts.setdefault(skip, {}))
        if req.params.stop:
            seq.stop_matcher = StopStringMatcher(req.params.stop, req.params.include_stop_str_in_output)

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """The prompt is done: the request becomes n sequences sharing its blocks."""
        seqs = [parent]
        for i in range(1, req.params.n):
            child = self.new_seq(req, i, list(parent.token_ids))
            child.output_token_ids = list(parent.output_token_ids)
            if parent.grammar is not None:  # before the parent accepts its own first token
                child.grammar = parent.grammar.fork()
            self.scheduler.fork_seq(parent, child)
            seqs.append(child)
        req.seqs = seqs
        req.forked = True
        return seqs

    # ---- the step ---------------------------------------------------------------------------

    def process(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        deltas: dict[str, Deltas] = {}
        touched: dict[str, Request] = {}
        sampled, logprobs, prompt_logprobs = result.sampled, result.logprobs, result.prompt_logprobs
        cache_computed_blocks = self.scheduler.cache_computed_blocks
        for sch in out.scheduled:
            seq, req = sch.seq, sch.request
            if seq.finish_reason is not None or req.status == RequestStatus.FINISHED:
                continue  # finished (or aborted) while this step was in flight: drop its token
            if prompt_logprobs:
                entries = prompt_logprobs.get(seq.seq_id)
                if entries is not None:
                    req.prompt_logprobs.extend(self._decode_logprobs(e) for e in entries)
            cache_computed_blocks(req, seq)
            if not sch.completes:
                continue
            tokens = sampled[seq.seq_id]
            lps = logprobs.get(seq.seq_id) if logprobs else None
            request_deltas = deltas.get(req.request_id)
            if request_deltas is None:
                request_deltas = deltas[req.request_id] = {}
            if sch.spec_token_ids:
                request_deltas[seq.index] = self._append_verified(req, seq, tokens, lps or [None] * len(tokens))
            elif len(tokens) == 1 and not req.needs_fork:  # one sample of one sequence: most rows
                request_deltas[seq.index] = self._append_token(req, seq, tokens[0], lps[0] if lps else None)
            else:
                targets = self._fork(req, seq) if req.needs_fork else [seq]
                for target, token, lp in zip(targets, tokens, lps or [None] * len(tokens)):
                    request_deltas[target.index] = self._append_token(req, target, token, lp)
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            touched[req.request_id] = req
        outputs = []
        for rid, req in touched.items():
            finished = req.finished
            if finished:
                self.scheduler.finish(req)
            if finished or req.params.output_kind == "delta":
                outputs.append(self.make_output(req, deltas.get(rid, {})))
        return outputs

    def _append_token(self, req: Request, seq: Sequence, token: int,
                      lp: Optional[dict]) -> tuple[list[int], str]:
        params = req.params
        seq.append_token(token)
        self.num_generated_tokens += 1
        if lp is not None:
            seq.output_logprobs.append(self._decode_logprobs(lp))
        # A request that reads its text only at the end (output_kind "final") and has no stop
        # strings to match: its tokens are detokenized when it finishes (or is aborted), not
        # each step; _catch_up_text replays them one by one, so the text is the same.
        defer = seq.stop_matcher is None and params.output_kind == "final"
        text = seq.detokenizer.step([token]) if seq.detokenizer is not None and not defer else ""
        n_out = len(seq.output_token_ids)
        past_min = n_out >= params.min_tokens
        stop_str = None
        if seq.stop_matcher is not None:
            text, stop_str = seq.stop_matcher.feed(text)
        if stop_str is not None and past_min:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif params.stop_token_ids and token in params.stop_token_ids and past_min:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos and past_min:
            seq.finish_reason = "stop"
        elif n_out >= req.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        elif seq.grammar is not None and not seq.grammar.accept(token):
            # The grammar forbade the token (the mask was overridden, e.g. min_tokens
            # suppressed the only token it allowed): the output can no longer be valid.
            logger.warning("request %s: sampled token %d breaks its grammar; stopping it",
                           req.request_id, token)
            seq.finish_reason = "abort"
        if seq.finish_reason is not None:
            if defer:
                text = self._catch_up_text(seq, keep_last=True)
            text += self._flush_text(seq, stopped_by_string=stop_str is not None)
            self.scheduler.free_seq(seq)
        if text:
            seq.output_text += text
        return [token], text

    def _append_verified(self, req: Request, seq: Sequence, tokens: list[int],
                         lps: list[Optional[dict]]) -> tuple[list[int], str]:
        """A verify step's tokens (accepted drafts, then one more), appended one at a time:
        a stop string, stop token or max_tokens cuts them where plain decoding would have
        stopped. Then the K/V of rejected drafts is rolled back."""
        ids, text = [], ""
        for token, lp in zip(tokens, lps):
            _, piece = self._append_token(req, seq, token, lp)
            ids.append(token)
            text += piece
            if seq.finished:
                break
        self.scheduler.rollback_spec(seq)
        return ids, text

    @staticmethod
    def _catch_up_text(seq: Sequence, keep_last: bool = False) -> str:
        """Detokenize a deferred sequence's tokens the detokenizer has not seen, one at a time as
        _append_token would have: their text goes into output_text, except the last token's
        with keep_last, which is returned (the step's delta, as without deferral)."""
        detok = seq.detokenizer
        if detok is None:
            return ""
        unseen = len(seq.output_token_ids) - len(detok.output_token_ids)
        if unseen <= 0:
            return ""
        tokens = seq.output_token_ids[-unseen:]
        last = tokens.pop() if keep_last else None
        seq.output_text += "".join([detok.step([token]) for token in tokens])
        return detok.step([last]) if keep_last else ""

    @staticmethod
    def _flush_text(seq: Sequence, stopped_by_string: bool) -> str:
        if stopped_by_string:
            return ""
        tail = seq.detokenizer.flush() if seq.detokenizer is not None else ""
        if seq.stop_matcher is not None:
            text, _ = seq.stop_matcher.feed(tail)
            return text + seq.stop_matcher.flush()
        return tail

    # ---- logprobs and outputs ---------------------------------------------------------------

    def _decode_logprobs(self, entry: Optional[dict]) -> Optional[Logprobs]:
        if entry is None:
            return None
        return {tid: TokenLogprob(lp, rank, self._token_text(tid)) for tid, (lp, rank) in entry.items()}

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def make_output(self, req: Request, deltas: Deltas) -> RequestOutput:
        if req.params.output_kind == "final":  # an abort reads the text of deferred tokens too
            for seq in req.seqs:
                self._catch_up_text(seq)
        # Most requests hold one sequence: no sort for them.
        seqs = req.seqs if len(req.seqs) == 1 else sorted(req.seqs, key=lambda s: s.index)
        want_logprobs = req.params.logprobs is not None
        completions = []
        delta_text, delta_ids = [], []
        for seq in seqs:
            completions.append(CompletionOutput(
                # The live list, not a copy: copying every step would cost O(length^2).
                index=seq.index, text=seq.output_text, token_ids=seq.output_token_ids,
                logprobs=seq.output_logprobs if want_logprobs else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            ids, text = deltas.get(seq.index, ([], ""))
            delta_ids.append(ids)
            delta_text.append(text)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=completions, finished=req.finished, prompt_logprobs=req.prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens, delta_text=delta_text, delta_token_ids=delta_ids,
            arrival_time=req.arrival_time, first_token_time=req.first_token_time)
