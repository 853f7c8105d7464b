"""Prompts as token ids: completions' text or ids, chat messages through the model's template.

Tokenizing and rendering run in a worker thread: a long prompt must not stall
the event loop. Chat templates render in transformers' ImmutableSandboxedEnvironment,
and message content is data, never template code.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from rooflm.server import protocol as p


@dataclass
class PreparedPrompt:
    text: Optional[str]  # as sent, or the rendered chat prompt; None for token ids
    token_ids: list[int]


def _require_tokenizer(tokenizer, param: str) -> None:
    if tokenizer is None:
        raise p.RequestError("this model has no tokenizer (dummy weights): send token ids",
                             param=param)


async def completion_prompts(tokenizer, request: p.CompletionRequest) -> list[PreparedPrompt]:
    prepared = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            _require_tokenizer(tokenizer, "prompt")
            if request.split_special_tokens:
                ids = await asyncio.to_thread(tokenizer.encode_plain_text, prompt)
            else:
                ids = await asyncio.to_thread(tokenizer.encode, prompt)
            if not ids:
                raise p.RequestError("the prompt encodes to no tokens", param="prompt")
            prepared.append(PreparedPrompt(prompt, ids))
        else:
            prepared.append(PreparedPrompt(None, list(prompt)))
    return prepared


async def chat_prompt(tokenizer, request: p.ChatCompletionRequest,
                      split_special_tokens: bool = False) -> PreparedPrompt:
    """split_special_tokens: the server's default (--split-special-tokens) where the request
    does not say; True keeps special tokens typed in message content as plain text."""
    _require_tokenizer(tokenizer, "messages")
    conversation = request.conversation()
    add_generation_prompt = request.add_generation_prompt is not False
    tools = request.template_tools()
    if request.split_special_tokens is not None:
        split_special_tokens = request.split_special_tokens
    try:
        text, ids = await asyncio.to_thread(tokenizer.encode_chat, conversation,
                                            add_generation_prompt, split_special_tokens, tools)
    except Exception as exc:  # noqa: BLE001 - ValueError and jinja2's TemplateError (incl. SecurityError)
        if not isinstance(exc, ValueError) and "jinja2" not in type(exc).__module__:
            raise
        raise p.RequestError(f"cannot apply the chat template: {exc}", param="messages") from None
    return PreparedPrompt(text, ids)


def prompt_text(tokenizer, prompt: PreparedPrompt) -> str:
    """The prompt as text, for echo: as sent, or decoded from its token ids."""
    if prompt.text is not None:
        return prompt.text
    if tokenizer is None:
        return ""
    return tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
