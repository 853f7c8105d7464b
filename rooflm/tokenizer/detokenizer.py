"""Token ids -> text, one step at a time, and stop strings on that text.

Why not decode each new token on its own: a multi-byte character can span
several byte-level tokens (each alone decodes to U+FFFD), and SentencePiece
decoders strip the leading space of the first token they see, so decode of a
suffix is not a suffix of decode. The incremental detokenizer therefore
decodes a short window that starts a few tokens before the new ones (the
prefix, already emitted) and emits the difference, the technique of vLLM's
detokenize_incrementally (HF's TextStreamer diffs a growing decode alike):

    token ids:  ... | prefix_offset ... read_offset | new tokens
    prefix_text = decode(ids[prefix_offset:read_offset])
    full_text   = decode(ids[prefix_offset:])
    delta       = full_text[len(prefix_text):]

and holds the new tokens back while full_text ends with U+FFFD (an incomplete
character that the next token may complete). Each step decodes only the
window, so the cost per step does not grow with the output.

Byte-fallback tokenizers (Llama 2, Mistral, Gemma) need one more rule: their
decoder turns a whole run of consecutive <0xNN> tokens into U+FFFDs when the
run is not valid UTF-8, even bytes it had shown as text while the run was
shorter. So text is also held while the newest token is a byte token: a run
is only emitted once a non-byte token has closed it, and every window then
starts on a run boundary.
"""

from __future__ import annotations

import re
from typing import Optional

REPLACEMENT_CHAR = "\ufffd"

# SentencePiece byte-fallback tokens spell one raw byte, e.g. "<0xE4>".
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    """Streams one sequence's output text as deltas.

    The concatenation of all step() deltas and the final flush() equals
    tokenizer.decode(output_token_ids, skip_special_tokens=...): the output
    is decoded on its own, not as a continuation of the prompt. For
    byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2) that is the
    same text; for SentencePiece ones it lacks the leading space that the
    first output token would show after the prompt.

    Assumes the tokenizer's clean_up_tokenization_spaces is off (the default
    for BPE tokenizers in transformers 5): that clean-up rewrites text across
    window boundaries, which no windowed decode can reproduce exactly.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 token_texts: Optional[dict[int, str]] = None):
        # Our Tokenizer wrapper exposes the transformers tokenizer as `.hf`.
        self.tokenizer = getattr(tokenizer, "hf", tokenizer)
        # Kept for callers; not used as decode context (see the docstring).
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.output_token_ids: list[int] = []
        model = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "model", None)
        self._byte_fallback = bool(getattr(model, "byte_fallback", False))
        # A superset of what decode skips (it may include <unk>): treating a
        # kept token as skipped can only make us hold text one token longer.
        self._special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        self._prefix_offset = 0
        self._read_offset = 0
        self._output_text = ""
        # decode([token]) by token id, shared by the detokenizers of one tokenizer and
        # skip_special_tokens setting (the engine's output processor holds it; at most one
        # entry per vocabulary id). In steady decoding the window's prefix is the one token
        # emitted last step, so this saves one of the two decodes per step.
        self._token_texts = token_texts if token_texts is not None else {}
        # The Rust tokenizer's own decode, without transformers' Python wrapper around it: the
        # wrapper (argument conversion, to_py_obj, ...) was 6.0 of the 6.4 s that 400k window
        # decodes took in an H100 serving run's engine core (cProfile). Same text unless the
        # wrapper's clean-up of tokenization spaces is on, where the wrapper is kept.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_ids = backend.decode
        else:
            self._decode_ids = self.tokenizer.decode

    @property
    def output_text(self) -> str:
        """The text emitted so far (without what is held back)."""
        return self._output_text

    def step(self, new_token_ids: list[int]) -> str:
        """Adds the tokens of this step and returns the new text, maybe ''."""
        self.output_token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Releases held-back text at the end of the sequence.

        If the output ends inside a multi-byte character, the delta ends with
        U+FFFD, as the one-shot decode does.
        """
        return self._advance(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        ids = self.output_token_ids
        if self._read_offset - self._prefix_offset == 1:
            token_id = ids[self._prefix_offset]
            prefix_text = self._token_texts.get(token_id)
            if prefix_text is None:
                prefix_text = self._token_texts[token_id] = self._decode([token_id])
        else:
            prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        # Nothing new: skipped special tokens, or no new tokens at all.
        if len(full_text) <= len(prefix_text):
            return ""
        if not final and (full_text.endswith(REPLACEMENT_CHAR) or self._ends_in_open_byte_run()):
            return ""
        delta = full_text[len(prefix_text) :]
        # The tokens just emitted become the next window's prefix: enough
        # context for the decoder, and the window stays a few tokens long.
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._output_text += delta
        return delta

    def _ends_in_open_byte_run(self) -> bool:
        if not self._byte_fallback:
            return False
        # Tokens before read_offset are settled: every earlier advance
        # happened after a token that was not a byte token.
        for token_id in reversed(self.output_token_ids[self._read_offset :]):
            if self.skip_special_tokens and token_id in self._special_ids:
                continue
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            return token is not None and _BYTE_TOKEN.fullmatch(token) is not None
        return False


class StopStringMatcher:
    """Finds stop strings in a stream of text deltas.

    feed() returns the text that is safe to emit now. It holds back the
    longest tail that is still the start of some stop string (at most
    max(len(stop)) - 1 characters) and releases it once it can no longer
    match, so a stop string split over several deltas is still caught and
    never partly streamed.

    When several stop strings occur, the one that completes first in the text
    wins (ties: the longer one). That rule gives the same answer however the
    text is cut into deltas, since a stream sees the first completed match
    first.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: Optional[str] = None  # set once a stop string is found
        self._held = ""

    def feed(self, delta: str) -> tuple[str, Optional[str]]:
        """Returns (text to emit now, the stop string matched or None).

        On a match the emitted text ends just before the stop string (or just
        after it with include_stop_str_in_output) and everything after it is
        dropped; the sequence is finished, and later feeds return ("", None).
        """
        if self.matched is not None:
            return "", None
        text = self._held + delta
        match = self._find_first_match(text, new_from=len(self._held))
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str_in_output else start
            self._held = ""
            self.matched = stop
            return text[:end], stop
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Releases the held tail when the sequence finished otherwise."""
        held = self._held
        self._held = ""
        return held

    def _find_first_match(self, text: str, new_from: int) -> Optional[tuple[int, str]]:
        # A match lying wholly in the held text would have been found by an
        # earlier feed, so only matches ending in the new delta are searched.
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
        for stop in self.stop:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        return best[1], best[2]

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest tail of text that begins some stop string."""
        longest_stop = max((len(s) for s in self.stop), default=0)
        for length in range(min(len(text), longest_stop - 1), 0, -1):
            tail = text[len(text) - length :]
            if any(len(stop) > length and stop.startswith(tail) for stop in self.stop):
                return length
        return 0
