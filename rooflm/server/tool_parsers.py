"""Tool-call parsers, one per output format, for whole texts and for streams.

A template family decides how its model writes a call:
  hermes       Hermes 2 Pro, Qwen 2/2.5/3 and most ChatML templates:
               <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, one block per call,
               free text before the first block is the message's content.
  llama3_json  Llama 3.1+: the whole reply is {"name": "f", "parameters": {...}}, optionally after
               <|python_tag|>, several calls separated by ";".
  json_array   what tool_choice "required" makes any model write (choice.py's schema):
               [{"name": "f", "parameters": {...}}, ...]
A reply that does not parse as calls is plain content: a model may always answer in text
under tool_choice "auto".

Streaming, as vLLM and OpenAI stream calls: content passes through until the text could be
the start of a call; from there a call object is read character by character
(CallScanner), and as soon as its name is complete the call's first delta goes out (id and
name), then its arguments' JSON text in fragments as the model writes them. The
arguments are the model's own text (not re-serialized), so the fragments of a stream join
to exactly the arguments of the whole-text parse, which runs the same stream over the
whole text. One difference is unavoidable: a call whose arguments turn out malformed after
its first delta went out stays a call in the stream, while the whole-text parse gives the
reply back as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class CallDelta:
    """A streamed piece of the reply's call number `index`: its first piece carries id and
    name; every piece may carry more of the arguments' text."""

    index: int
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None


# Keys a call object may hold its arguments under: Hermes/Qwen write "arguments", Llama 3.1
# and the "required" schema "parameters".
ARGUMENT_KEYS = ("arguments", "parameters")


class CallScanner:
    """Reads one JSON object {"name": ..., "arguments": {...}} as it is written, character by
    character, and says what is known so far: the name once its string is closed, the
    arguments' text as far as it has come, and whether the object has closed."""

    def __init__(self):
        self.text = ""
        self.depth = 0
        self._in_string = False
        self._escape = False
        # What comes next at the object's top level: open, key, colon, value, in_value, comma.
        self._expect = "open"
        self._key: Optional[str] = None
        self._start = 0  # of the current key or top-level value
        self._primitive = False  # the top-level value in progress is a number/true/false/null
        self.name: Optional[str] = None
        self._args_start: Optional[int] = None
        self._args_end: Optional[int] = None
        self._args_is_string = False
        self.done = False
        self.failed = False

    def feed(self, text: str) -> str:
        """Read text; returns what comes after the object once it has closed (else "")."""
        begin = len(self.text)
        self.text += text
        for i in range(begin, len(self.text)):
            if self.done or self.failed:
                break
            self._step(i, self.text[i])
            if self.done:
                rest = self.text[i + 1:]
                self.text = self.text[:i + 1]
                return rest
        return ""

    def _step(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self.depth == 1:
                    self._string_closed(i)
            return
        if self.depth == 0:
            if c == "{" and self._expect == "open":
                self.depth, self._expect = 1, "key"
            elif not c.isspace():
                self.failed = True
            return
        if self.depth == 1 and self._expect == "in_value" and self._primitive \
                and (c in ",}" or c.isspace()):
            self._value_closed(i)
        if c == '"':
            self._in_string = True
            if self.depth == 1:
                if self._expect == "key":
                    self._start = i
                elif self._expect == "value":
                    self._value_started(i, primitive=False)
                else:
                    self.failed = True
        elif c in "{[":
            if self.depth == 1:
                if self._expect != "value":
                    self.failed = True
                    return
                self._value_started(i, primitive=False)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self._expect == "in_value":
                self._value_closed(i + 1)
            elif self.depth == 0:
                if c != "}" or self._expect not in ("key", "comma"):
                    self.failed = True
                else:
                    self.done = True
        elif self.depth == 1:
            if c == ":" and self._expect == "colon":
                self._expect = "value"
            elif c == "," and self._expect == "comma":
                self._expect = "key"
            elif c.isspace():
                pass
            elif self._expect == "value":
                self._value_started(i, primitive=True)
            elif not (self._expect == "in_value" and self._primitive):
                self.failed = True

    def _string_closed(self, i: int) -> None:
        if self._expect == "key":
            self._key = json.loads(self.text[self._start:i + 1])
            self._expect = "colon"
        elif self._expect == "in_value":
            self._value_closed(i + 1)

    def _value_started(self, i: int, primitive: bool) -> None:
        self._start, self._primitive, self._expect = i, primitive, "in_value"
        if self._key in ARGUMENT_KEYS and self._args_start is None:
            self._args_start = i
            self._args_is_string = self.text[i] == '"'

    def _value_closed(self, end: int) -> None:
        self._expect = "comma"
        raw = self.text[self._start:end]
        if self._key == "name" and self.name is None:
            value = json.loads(raw) if raw.startswith('"') else None
            if isinstance(value, str) and value:
                self.name = value
            else:
                self.failed = True
        elif self._start == self._args_start:
            self._args_end = end

    def arguments(self) -> str:
        """The arguments' JSON text as far as it is known. Arguments written as a JSON string
        (some models do) are known once the string closes, and are its content."""
        if self._args_start is None:
            return "{}" if self.done else ""
        if self._args_is_string:
            if self._args_end is None:
                return ""
            return json.loads(self.text[self._args_start:self._args_end])
        end = self._args_end if self._args_end is not None else len(self.text)
        return self.text[self._args_start:end]

    def call(self) -> Optional[ToolCall]:
        """The whole call, if the object closed with a name and arguments that are an object."""
        if not self.done or self.failed or self.name is None:
            return None
        try:
            arguments = json.loads(self.arguments())
        except ValueError:
            return None
        return ToolCall(self.name, self.arguments()) if isinstance(arguments, dict) else None


class _CallInProgress:
    """One call of a stream: its scanner and how much of it has been sent."""

    def __init__(self, index: int):
        self.index = index
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.scanner = CallScanner()
        self.header_sent = False
        self.num_sent = 0  # characters of the arguments sent

    def deltas(self) -> list[CallDelta]:
        scanner = self.scanner
        if scanner.name is None:
            return []
        arguments = scanner.arguments()
        fragment = arguments[self.num_sent:]
        self.num_sent = len(arguments)
        if not self.header_sent:
            self.header_sent = True
            return [CallDelta(self.index, fragment, self.id, scanner.name)]
        return [CallDelta(self.index, fragment)] if fragment else []

    def whole(self) -> Optional[ToolCall]:
        call = self.scanner.call()
        if call is not None:
            call.id = self.id
        return call


class StreamingToolParser:
    """One choice's stream: feed() each text delta, finish() at the end. Both return
    (content delta, call deltas). Subclasses say where calls begin and what separates them."""

    def __init__(self):
        self._held = ""  # text not yet sent: a possible call start, or a call in progress
        self._state = "start"
        self._calls: list[_CallInProgress] = []
        self._call_text = ""  # the text of the current call, given back if it is not one

    @property
    def calls(self) -> list[_CallInProgress]:
        return self._calls

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self._held += delta
        content, deltas = [], []
        while self._advance(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """End of the reply: a call start that never became a call is content after all."""
        held, self._held = self._held, ""
        if self._state == "call" and not (self._calls and self._calls[-1].header_sent):
            self._calls.pop()
            held = self._call_text
        if self._calls and any(c.header_sent for c in self._calls):
            return "", []
        return held, []

    # ---- shared steps ----

    def _open_call(self, prefix: str) -> None:
        self._calls.append(_CallInProgress(len(self._calls)))
        self._call_text = prefix
        self._state = "call"

    def _feed_call(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Give held text to the current call; True when the call closed (state moves on)."""
        call = self._calls[-1]
        text, self._held = self._held, ""
        self._call_text += text
        rest = call.scanner.feed(text)
        if call.scanner.done and call.scanner.name is None:
            call.scanner.failed = True  # an object, but not a call
        if call.scanner.failed:
            if call.header_sent:  # already a call for the client: the rest is dropped
                self._state = "dropped"
            else:
                self._calls.pop()
                if not self._calls:
                    content.append(self._call_text)
                self._state = "content" if not self._calls else "dropped"
            return False
        deltas.extend(call.deltas())
        if not call.scanner.done:
            return False
        self._held = rest
        self._state = "after_call"
        return True

    def _advance(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """One move of the state machine over held text; False: wait for more text."""
        raise NotImplementedError


def _partial_prefix(text: str, marker: str) -> int:
    """Where in text the marker, or a prefix of it cut at the end, begins; -1: nowhere."""
    index = text.find(marker)
    if index >= 0:
        return index
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return -1


class ToolParser:
    """Whole-text parsing is the stream run over the whole text."""

    name = ""

    def stream(self) -> StreamingToolParser:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, calls): calls is empty when the text holds none, and content is the text."""
        stream = self.stream()
        content, _ = stream.feed(text)
        tail, _ = stream.finish()
        calls = [c.whole() for c in stream.calls]
        if not calls or any(c is None for c in calls):
            return text, []
        content = (content + tail).strip()
        return (content or None), calls


class _HermesStream(StreamingToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def _advance(self, content, deltas) -> bool:
        state, held = self._state, self._held
        if state in ("start", "content"):
            start = _partial_prefix(held, self.START)
            if start < 0:
                if not self._calls:
                    content.append(held)
                self._held = ""
                return False
            if not self._calls:
                content.append(held[:start])
            self._held = held[start:]
            if not self._held.startswith(self.START):
                return False  # a cut marker: wait
            self._held = self._held[len(self.START):]
            self._open_call(self.START)
            return True
        if state == "call":
            return self._feed_call(content, deltas)
        if state == "after_call":
            stripped = held.lstrip()
            if stripped.startswith(self.END):
                self._held = stripped[len(self.END):]
                self._state = "content"
                return True
            if not stripped or self.END.startswith(stripped):
                return False
            self._state = "content"  # no closing tag: take the call as closed
            return True
        self._held = ""  # dropped
        return False


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> StreamingToolParser:
        return _HermesStream()


class _Llama3Stream(StreamingToolParser):
    TAG = "<|python_tag|>"

    def _advance(self, content, deltas) -> bool:
        state, held = self._state, self._held
        if state == "start":
            stripped = held.lstrip()
            if not stripped or (self.TAG.startswith(stripped) and stripped != self.TAG):
                return False  # nothing yet, or a cut tag: wait
            if stripped.startswith(self.TAG):
                stripped = stripped[len(self.TAG):].lstrip()
                if not stripped:
                    return False
            if stripped.startswith("{"):
                self._held = stripped
                self._open_call(held[:len(held) - len(stripped)])
                return True
            self._state = "content"  # a Llama reply is a call only if it opens with one
            return True
        if state == "content":
            content.append(held)
            self._held = ""
            return False
        if state == "call":
            return self._feed_call(content, deltas)
        if state == "after_call":
            stripped = held.lstrip(" \t\r\n;")
            if stripped.startswith("{"):
                self._held = stripped
                self._open_call("")
                return True
            self._held = stripped if not stripped else ""
            if stripped:
                self._state = "dropped"
            return False
        self._held = ""
        return False


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> StreamingToolParser:
        return _Llama3Stream()


class _JsonArrayStream(StreamingToolParser):
    def _advance(self, content, deltas) -> bool:
        state, held = self._state, self._held
        if state == "start":
            stripped = held.lstrip()
            if not stripped:
                return False
            if not stripped.startswith("["):
                self._state = "content"
                return True
            self._held = stripped[1:]
            self._state = "item"
            return True
        if state == "item":
            stripped = held.lstrip()
            if not stripped:
                return False
            self._held = stripped
            self._open_call("")
            return True
        if state == "call":
            return self._feed_call(content, deltas)
        if state == "after_call":
            stripped = held.lstrip()
            if not stripped:
                return False
            self._held = stripped[1:]
            self._state = "item" if stripped[0] == "," else "dropped"
            return True
        if state == "content" and not self._calls:
            content.append(held)
        self._held = ""
        return False


class JsonArrayToolParser(ToolParser):
    name = "json_array"

    def stream(self) -> StreamingToolParser:
        return _JsonArrayStream()


PARSERS = {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, JsonArrayToolParser)}


def parser_for_template(chat_template: Optional[str]) -> ToolParser:
    """The parser for a chat template's family. A template that writes <|python_tag|> or an
    ipython role is Llama 3.1+; anything else (Hermes, Qwen, ChatML without tool support)
    gets the <tool_call> format, which ChatML models follow best when told about it."""
    template = chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonToolParser()
    return HermesToolParser()
