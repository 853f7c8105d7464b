"""Tools and tool turns reach the chat template: rendered through a Qwen-style template that
writes them (SmolLM2's own template ignores tools), with the real tokenizer."""

import asyncio
import copy

import pytest

from rooflm.server import protocol as p
from rooflm.server.prompts import chat_prompt
from rooflm.server.tools import ToolCalling
from rooflm.server.tool_parsers import HermesToolParser

# The shape of Qwen 2.5's tool template, cut down: tools as JSON in the system turn, calls as
# <tool_call> blocks, tool answers in <tool_response>.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    from rooflm.model.loader import resolve_model
    from rooflm.tokenizer.tokenizer import load_model_tokenizer
    path, fmt = resolve_model(None, "auto")
    tok = copy.copy(load_model_tokenizer(None, path, fmt))
    tok.hf = copy.deepcopy(tok.hf)
    tok.hf.chat_template = TOOL_TEMPLATE
    return tok


def request(**fields) -> p.ChatCompletionRequest:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}], **fields}
    req = p.validate_request(p.ChatCompletionRequest, body)
    req.check(p.RequestLimits(max_n=4, vocab_size=49152, max_model_len=512))
    return req


def test_tools_and_tool_turns_are_rendered(tokenizer):
    prompt = asyncio.run(chat_prompt(tokenizer, request(tools=[TOOL])))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in prompt.text
    # The call's arguments reach the template as an object, as templates expect.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt.text
    assert "<tool_response>21 C</tool_response>" in prompt.text
    assert prompt.token_ids == tokenizer.encode(prompt.text, False)


def test_tool_choice_none_keeps_tools_out_of_the_template(tokenizer):
    prompt = asyncio.run(chat_prompt(tokenizer, request(tools=[TOOL], tool_choice="none")))
    assert "<tools>" not in prompt.text


def test_the_template_family_picks_the_parser(tokenizer):
    calling = ToolCalling(request(tools=[TOOL]), tokenizer.chat_template)
    assert calling.mode == "auto" and isinstance(calling.parser, HermesToolParser)
    content, calls = calling.extract('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert content is None and calls[0].name == "get_weather"
