"""Tool-call parsers, one per chat-template family, for whole texts and for streams.

A template family decides how its model writes a call:
  hermes       Hermes 2 Pro, Qwen 2/2.5/3 and most ChatML templates:
               <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, one block per call,
               free text before the first block is the message's content.
  llama3_json  Llama 3.1+: the whole reply is {"name": "f", "parameters": {...}}, optionally after
               <|python_tag|>, several calls separated by ";".
A reply that does not parse as calls is plain content: a model may always answer in text
under tool_choice "auto".

Streaming: content is passed through until the text could be the start of a call; from
there the parser holds text back, and emits each call whole as soon as it is complete
(Hermes: at its closing tag; Llama: at the end of the reply). OpenAI's delta shape allows
a call's arguments in one piece.
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


def _call_from_json(obj, arguments_key: str) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    """Whole-text parsing; subclasses know their family's markers."""

    name = ""
    # Text that may begin a call; content is held back from the first character that could
    # be its start.
    start_marker = ""

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, calls): calls is empty when the text holds none, and content is the text."""
        raise NotImplementedError

    def stream(self) -> "StreamingToolParser":
        return StreamingToolParser(self)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        start = text.find(self.start_marker)
        if start < 0:
            return text, []
        calls = []
        rest = text[start:]
        while rest.startswith(self.start_marker):
            end = rest.find(self.end_marker)
            body = rest[len(self.start_marker):end if end >= 0 else len(rest)]
            call = self._parse_block(body)
            if call is None:
                return text, []
            calls.append(call)
            if end < 0:
                break
            rest = rest[end + len(self.end_marker):].lstrip()
        content = text[:start].strip()
        return (content or None), calls

    @staticmethod
    def _parse_block(body: str) -> Optional[ToolCall]:
        try:
            return _call_from_json(json.loads(body.strip()), "arguments")
        except ValueError:
            return None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_marker = "<|python_tag|>"

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.start_marker):
            body = body[len(self.start_marker):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            call = _call_from_json(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return None, calls


class StreamingToolParser:
    """One choice's stream: feed() each text delta, finish() at the end. Both return
    (content delta, calls completed by it)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.held = ""  # text not yet sent: a possible call start, or a call in progress
        self.in_call = False
        self.sent_content = False

    def _may_start_call(self, text: str) -> int:
        """Where in text a call could begin (the marker, or a prefix of it at the end); -1: nowhere."""
        marker = self.parser.start_marker
        index = text.find(marker)
        if index >= 0:
            return index
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                return len(text) - k
        if isinstance(self.parser, Llama3JsonToolParser) and not self.sent_content:
            stripped = text.lstrip()
            if stripped.startswith("{") or not stripped:
                return 0  # a Llama reply that opens with "{" is a call until it fails to parse
        return -1

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        text = self.held + delta
        if not self.in_call:
            start = self._may_start_call(text)
            if start < 0:
                self.held = ""
                self.sent_content = self.sent_content or bool(text.strip())
                return text, []
            content, self.held = text[:start], text[start:]
            if content.strip():
                self.sent_content = True
            if self.held.startswith(self.parser.start_marker) or (
                    isinstance(self.parser, Llama3JsonToolParser) and self.held.strip()):
                self.in_call = True
            if self.in_call and isinstance(self.parser, HermesToolParser):
                return content, self._complete_hermes_blocks()[1]
            return content, []
        self.held = text
        if isinstance(self.parser, HermesToolParser):
            return self._complete_hermes_blocks()
        return "", []

    def _complete_hermes_blocks(self) -> tuple[str, list[ToolCall]]:
        parser = self.parser
        calls = []
        while True:
            held = self.held.lstrip()
            end = held.find(parser.end_marker)
            if not held.startswith(parser.start_marker) or end < 0:
                return "", calls
            call = HermesToolParser._parse_block(held[len(parser.start_marker):end])
            if call is None:
                return "", calls  # left for finish(), which gives it back as content
            calls.append(call)
            self.held = held[end + len(parser.end_marker):]

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self.held = self.held, ""
        if not held.strip():
            return "", []
        content, calls = self.parser.parse(held)
        if not calls:
            return held, []
        return (content or ""), calls


PARSERS = {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)}


def parser_for_template(chat_template: Optional[str]) -> ToolParser:
    """The parser for a chat template's family. A template that writes <|python_tag|> or an
    ipython role is Llama 3.1+; anything else (Hermes, Qwen, ChatML without tool support)
    gets the <tool_call> format, which ChatML models follow best when told about it."""
    template = chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonToolParser()
    return HermesToolParser()
