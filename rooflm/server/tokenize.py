"""POST /tokenize and /detokenize in vLLM's shapes, GET /tokenizer_info and GET /version.

/tokenize takes a prompt ({"prompt"}) or a conversation ({"messages", "tools",
"add_generation_prompt"}), which goes through the same chat-template path as
/v1/chat/completions, so a client can count exactly the tokens a chat request
will cost. /detokenize turns ids back into text. /tokenizer_info is vLLM's: the tokenizer's
configuration as tokenizer_config.json holds it (tokenizer_class, the special tokens, the chat
template, ...), which lm-eval reads instead of fetching the tokenizer from a model hub. `model` is optional, as in
vLLM; when sent it must be the served model's name.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel

from rooflm.server import protocol as p
from rooflm.server.prompts import chat_prompt
from rooflm.version import __version__
from rooflm.server.tools import check_tools

if TYPE_CHECKING:
    from rooflm.server.state import ServerState


class TokenizeCompletionRequest(p.OpenAIModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: Optional[bool] = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(p.OpenAIModel):
    model: Optional[str] = None
    messages: list[Any]  # checked as a chat request's messages are
    tools: Optional[list[Any]] = None  # as chat sends them: the template renders them (vLLM's field)
    add_generation_prompt: Optional[bool] = True
    # The chat template writes the special tokens itself (BOS included).
    add_special_tokens: Optional[bool] = False
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(p.OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# Keys of a tokenizer's init arguments that name files on the server: not the client's business.
_PATH_KEYS = ("name_or_path", "vocab_file", "merges_file", "tokenizer_file", "special_tokens_map_file")


def tokenizer_info(state: "ServerState") -> dict[str, Any]:
    """The tokenizer's configuration in tokenizer_config.json's shape (vLLM's /tokenizer_info)."""
    hf = _tokenizer(state, "tokenizer").hf
    info = {key: _json_value(value) for key, value in getattr(hf, "init_kwargs", {}).items()
            if key not in _PATH_KEYS}
    info["tokenizer_class"] = type(hf).__name__
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(hf, name, None)
        if token is not None:
            info[name] = str(token)
    # The engine's context, not the tokenizer's nominal one (often 1e30 for "no limit").
    info["model_max_length"] = state.info.max_model_len
    template = state.tokenizer.chat_template
    if template:
        info["chat_template"] = template  # --chat-template's, when it replaced the model's
    return info


def _json_value(value: Any) -> Any:
    """A tokenizer init argument as JSON: AddedToken as tokenizer_config.json writes it."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if hasattr(value, "content"):  # tokenizers.AddedToken
        return {"content": value.content, **{flag: getattr(value, flag) for flag in
                ("lstrip", "rstrip", "normalized", "single_word", "special") if hasattr(value, flag)}}
    return str(value)


def version() -> VersionResponse:
    return VersionResponse(version=__version__)


def _tokenizer(state: "ServerState", param: str):
    if state.tokenizer is None:
        raise p.RequestError("this model has no tokenizer (dummy weights): it cannot "
                             "tokenize or detokenize text", param=param)
    return state.tokenizer


def _check_model(state: "ServerState", model: Optional[str]) -> None:
    if model is not None:
        state.check_model(model)


async def tokenize(state: "ServerState", body: dict) -> TokenizeResponse:
    if "messages" in body:
        request = p.validate_request(TokenizeChatRequest, body)
        _check_model(state, request.model)
        tokenizer = _tokenizer(state, "messages")
        fields = {"model": state.model_name, "messages": request.messages,
                  "add_generation_prompt": request.add_generation_prompt}
        if request.tools is not None:
            fields["tools"] = request.tools
        chat = p.validate_request(p.ChatCompletionRequest, fields)
        chat.check(state.limits)
        check_tools(chat)
        prompt = await chat_prompt(tokenizer, chat)
        ids = prompt.token_ids
        if request.add_special_tokens:
            ids = await asyncio.to_thread(tokenizer.encode, prompt.text, True)
    else:
        request = p.validate_request(TokenizeCompletionRequest, body)
        _check_model(state, request.model)
        tokenizer = _tokenizer(state, "prompt")
        ids = await asyncio.to_thread(tokenizer.encode, request.prompt,
                                      request.add_special_tokens is not False)
    token_strs = None
    if request.return_token_strs:
        token_strs = tokenizer.hf.convert_ids_to_tokens(ids)
    return TokenizeResponse(count=len(ids), max_model_len=state.info.max_model_len, tokens=ids,
                            token_strs=token_strs)


async def detokenize(state: "ServerState", body: dict) -> DetokenizeResponse:
    request = p.validate_request(DetokenizeRequest, body)
    _check_model(state, request.model)
    tokenizer = _tokenizer(state, "tokens")
    # The tokenizer's own size: it may exceed the model's vocab (added tokens) or fall
    # short of it (padded embedding rows have no text).
    vocab_size = tokenizer.vocab_size
    for i, token_id in enumerate(request.tokens):
        if not 0 <= token_id < vocab_size:
            raise p.RequestError(f"tokens has id {p.short_repr(token_id)} at index {i}, outside "
                                 f"the tokenizer's vocabulary [0, {vocab_size})", param="tokens")
    text = await asyncio.to_thread(tokenizer.decode, request.tokens, False)
    return DetokenizeResponse(prompt=text)
