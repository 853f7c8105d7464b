"""Logprobs in OpenAI's two shapes: the legacy completions' parallel lists, and chat's per-token objects.

The engine gives, per position, {token id: TokenLogprob(logprob, rank, decoded)}
holding the sampled token and the top alternatives (rank 1 is the most likely).
"""

from __future__ import annotations

from typing import Optional

from rooflm.engine.outputs import CompletionOutput, TokenLogprob
from rooflm.server import protocol as p


def _ranked(entry: dict[int, TokenLogprob], limit: int) -> list[tuple[int, TokenLogprob]]:
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(tid, lp) for tid, lp in ranked if lp.rank <= limit][:limit]


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: list[int], entries: list[Optional[dict]], num_top: int,
                   start_offset: int = 0) -> p.CompletionLogprobs:
        """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
        result = p.CompletionLogprobs()
        offset = start_offset
        for token_id, entry in zip(token_ids, entries):
            if entry is None or token_id not in entry:
                text, logprob, top = self.token_text(token_id), None, None
            else:
                text, logprob = entry[token_id].decoded, entry[token_id].logprob
                top = {lp.decoded: lp.logprob for tid, lp in entry.items()
                       if lp.rank <= num_top or tid == token_id}
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def chat(self, token_ids: list[int], entries: list[Optional[dict]],
             num_top: int) -> p.ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, entries):
            if entry is None or token_id not in entry:
                continue
            chosen = entry[token_id]
            top = [p.ChatTopLogprob(token=lp.decoded, logprob=lp.logprob,
                                    bytes=list(lp.decoded.encode("utf-8")))
                   for _, lp in _ranked(entry, num_top)]
            content.append(p.ChatTokenLogprob(token=chosen.decoded, logprob=chosen.logprob,
                                              bytes=list(chosen.decoded.encode("utf-8")),
                                              top_logprobs=top))
        return p.ChatLogprobs(content=content)


def new_entries(sample: CompletionOutput, count: int) -> list[Optional[dict]]:
    """The logprob entries of a sample's newest `count` tokens."""
    if not count or not sample.logprobs:
        return [None] * count
    return list(sample.logprobs[-count:])


def join_logprobs(prompt: p.CompletionLogprobs, output: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """Echoed prompt logprobs followed by the output's, with continuous text offsets."""
    shift = sum(len(token) for token in prompt.tokens)
    return p.CompletionLogprobs(
        tokens=prompt.tokens + output.tokens,
        token_logprobs=prompt.token_logprobs + output.token_logprobs,
        top_logprobs=prompt.top_logprobs + output.top_logprobs,
        text_offset=prompt.text_offset + [offset + shift for offset in output.text_offset])
