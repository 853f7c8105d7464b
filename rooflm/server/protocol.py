"""The OpenAI wire format: request and response models (pydantic v2) and their checks.

A request is checked in two layers, before anything reaches the engine:
1. pydantic checks shapes and types in strict mode: "5" is not 5 and true is not
   1. A wrong type is a client bug; we name it rather than guess around it.
2. `check()` checks ranges and cross-field rules, with messages that name the
   field and the allowed range, and carry the field as the error's `param`.
Whatever slips past both still meets SamplingParams' own checks and the
engine's add_request, which raise InvalidRequest without changing any state;
its param is in the engine's vocabulary, and `field_for` names the field this
request sent it under.

Unknown fields are ignored, as vLLM does (OpenAI's own API rejects them):
SDKs, proxies and tools send vendor extras, and refusing those would break
clients that work unchanged against vLLM. The server logs their names.
Fields that OpenAI defines but rooflm does not implement (the legacy functions and
function_call, suffix, best_of != n) are refused when set, because ignoring them
would silently change the answer.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_serializer

from rooflm.sampling_params import (LOGIT_BIAS_LIMIT, MAX_LOGPROBS, SamplingParams,
                                    StructuredOutputsParams)

# OpenAI's limits on logprobs: the legacy completions API returns at most 5
# alternatives per token, chat at most 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = MAX_LOGPROBS

# Generous next to OpenAI's 4 stop strings, small enough that the stop matcher's
# per-token work and held-back text stay bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64

# Each prompt of a batched completion request becomes its own engine request.
MAX_PROMPTS_PER_REQUEST = 64

MAX_CACHE_SALT_CHARS = 256

# OpenAI accepts up to 300 biased tokens; each costs one sparse add per step.
MAX_LOGIT_BIAS_TOKENS = 1024

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class RequestError(Exception):
    """A client error, answered with OpenAI's error body (400 unless told otherwise)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 err_type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type
        self.code = code
        self.headers = headers or {}


@dataclass(frozen=True)
class RequestLimits:
    """What the served model and the server's flags allow a request to ask for."""

    max_n: int
    vocab_size: int
    max_model_len: int


# ---- helpers for messages -----------------------------------------------------------------------


def short_repr(value: Any, limit: int = 60) -> str:
    """A repr short enough for an error message, whatever the client sent."""
    text = repr(value)
    if len(text) > limit:
        return text[:limit] + "..."
    return text


def _check_range(name: str, value: Optional[float], low: float, high: float,
                 low_open: bool = False) -> None:
    if value is None:
        return
    below = value <= low if low_open else value < low
    if below or value > high:
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RequestError(f"{name} must be in {interval}, got {short_repr(value)}", param=name)


def _check_stop(stop: Union[str, list[str], None]) -> None:
    if stop is None:
        return
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > MAX_STOP_STRINGS:
        raise RequestError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(items)}",
                           param="stop")
    for item in items:
        if not item:
            raise RequestError("stop must not contain empty strings", param="stop")
        if len(item) > MAX_STOP_STRING_CHARS:
            raise RequestError(f"each stop string must have at most {MAX_STOP_STRING_CHARS} "
                               f"characters, got one of {len(item)}", param="stop")


def _check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise RequestError(f"{name} has token id {short_repr(token_id)} at index {i}; token ids "
                               f"must be in [0, {vocab_size})", param=name)


# ---- requests -----------------------------------------------------------------------------------


class OpenAIModel(BaseModel):
    # strict: no silent coercion of "1" to 1 or true to 1. extra="allow": see
    # the module docstring; model_extra lists the ignored fields.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = False
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm sends it).
    continuous_usage_stats: Optional[bool] = False


class SamplingRequest(OpenAIModel):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: Optional[int] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extensions, accepted under the same names.
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    # Keeps prefix-cache hits within one tenant: requests share cached K/V only
    # when their salts are equal.
    cache_salt: Optional[str] = None
    # vLLM's: under --scheduling-policy priority lower values are scheduled first (ties by
    # arrival); under fcfs only 0 is accepted.
    priority: Optional[int] = None
    # rooflm's: this request's time-to-first-token budget in milliseconds from arrival; a
    # request predicted to wait longer is refused at once with 503 (default: --ttft-slo-ms).
    deadline_ms: Optional[float] = None
    # True: special tokens' text in the prompt or message content stays plain text
    # (vLLM's /tokenize and HF's name); None: the server's default (chat only).
    split_special_tokens: Optional[bool] = None
    # Token id (as a string, JSON's only key type) -> bias in [-100, 100].
    logit_bias: Optional[dict[str, Any]] = None
    # Structured outputs: OpenAI's response_format, and vLLM's structured_outputs object and
    # older guided_* fields; server/structured.py turns whichever is set into the constraint.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # OpenAI fields rooflm does not implement; refused when set.
    best_of: Optional[int] = None
    # The constraint the handler resolved and checked (server/structured.py), for sampling_params.
    _constraint: Optional[StructuredOutputsParams] = PrivateAttr(default=None)

    def set_constraint(self, constraint: Optional[StructuredOutputsParams]) -> None:
        self._constraint = constraint

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_in_stream(self) -> bool:
        """Usage in every chunk, as vLLM: continuous_usage_stats counts only with include_usage."""
        return self.include_usage_in_stream and bool(self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def check(self, limits: RequestLimits) -> None:
        """Ranges and cross-field rules; raises RequestError naming the field."""
        n = self.num_samples
        if not 1 <= n <= limits.max_n:
            raise RequestError(f"n must be in [1, {limits.max_n}], got {short_repr(n)}", param="n")
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"{self.max_tokens_field()} must be >= 1, got {short_repr(max_tokens)}",
                               param=self.max_tokens_field())
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k is not None and not -1 <= self.top_k <= limits.vocab_size:
            raise RequestError(f"top_k must be -1 or 0 (disabled) or in [1, {limits.vocab_size}], "
                               f"got {short_repr(self.top_k)}", param="top_k")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        # vLLM's bound: finite and > 0 (1e400 in JSON parses to inf, and inf > 0).
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty < math.inf:
            raise RequestError(f"repetition_penalty must be a finite number > 0, got "
                               f"{short_repr(self.repetition_penalty)}", param="repetition_penalty")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise RequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {short_repr(self.seed)}",
                               param="seed")
        self._check_min_tokens(max_tokens)
        _check_stop(self.stop)
        self._check_stop_token_ids(limits.vocab_size)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true",
                               param="stream_options")
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise RequestError(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters, "
                               f"got {len(self.cache_salt)}", param="cache_salt")
        self._check_logit_bias(limits.vocab_size)
        if self.deadline_ms is not None and not 0 < self.deadline_ms < math.inf:
            raise RequestError(f"deadline_ms must be a finite number of milliseconds > 0, got "
                               f"{short_repr(self.deadline_ms)}", param="deadline_ms")
        if self.best_of is not None and self.best_of != n:
            raise RequestError(f"best_of is not supported (it may only equal n, {n})",
                               param="best_of")

    def _check_logit_bias(self, vocab_size: int) -> None:
        if not self.logit_bias:
            return
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                               f"{len(self.logit_bias)}", param="logit_bias")
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {short_repr(key)}",
                                   param="logit_bias") from None
            if not 0 <= token_id < vocab_size:
                raise RequestError(f"logit_bias has token id {token_id}; token ids must be in "
                                   f"[0, {vocab_size})", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"logit_bias values must be numbers, got {short_repr(value)} "
                                   f"for token {token_id}", param="logit_bias")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise RequestError(f"logit_bias values must be in [-100, 100], got "
                                   f"{short_repr(value)} for token {token_id}", param="logit_bias")

    def _check_min_tokens(self, max_tokens: Optional[int]) -> None:
        if self.min_tokens is None:
            return
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens must be >= 0, got {short_repr(self.min_tokens)}",
                               param="min_tokens")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise RequestError(f"min_tokens must be <= {self.max_tokens_field()} ({max_tokens}), "
                               f"got {self.min_tokens}", param="min_tokens")

    def _check_stop_token_ids(self, vocab_size: int) -> None:
        if self.stop_token_ids is None:
            return
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, got "
                               f"{len(self.stop_token_ids)}", param="stop_token_ids")
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def field_for(self, param: Optional[str]) -> Optional[str]:
        """The field of this request that an InvalidRequest's param (SamplingParams' and the
        engine's names) is about."""
        if param == "max_tokens":
            return self.max_tokens_field()
        return param

    def num_logprobs(self) -> Optional[int]:
        """Alternatives per sampled token for SamplingParams; None: no logprobs."""
        return None

    def sampling_params(self, max_tokens: int, prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """The engine's parameters, max_tokens already resolved against the prompt.

        SamplingParams checks everything again; its InvalidRequest names the field.
        """
        # A temperature too small to divide by is greedy: SamplingParams.greedy decides.
        return SamplingParams(
            n=self.num_samples,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logprobs=self.num_logprobs(),
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=self._constraint,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None

    # OpenAI's default for the legacy completions API.
    DEFAULT_MAX_TOKENS: ClassVar[int] = 16

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        prompts = self.prompts()
        if not prompts:
            raise RequestError("prompt must not be empty", param="prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise RequestError(f"prompt may hold at most {MAX_PROMPTS_PER_REQUEST} prompts, got "
                               f"{len(prompts)}", param="prompt")
        for prompt in prompts:
            if len(prompt) == 0:
                raise RequestError("prompt must not contain an empty prompt", param="prompt")
            if not isinstance(prompt, str):
                _check_token_ids("prompt", prompt, limits.vocab_size)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got "
                               f"{short_repr(self.logprobs)}", param="logprobs")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")

    def num_logprobs(self) -> Optional[int]:
        return self.logprobs


class ContentPart(OpenAIModel):
    type: str
    text: Optional[str] = None


class ChatMessage(OpenAIModel):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    # An assistant turn that called tools (content may then be null), and a tool's answer.
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content or [])


# Where a chat request holds what the engine calls by another name: the prompt is
# rendered from the messages, and SamplingParams' logprobs count is top_logprobs.
_CHAT_FIELDS = {"prompt": "messages", "logprobs": "top_logprobs"}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    # vLLM's extension: end the prompt with the assistant turn's header.
    add_generation_prompt: Optional[bool] = True
    # Tool calling (server/tools.py): function definitions, which (if any) must be called,
    # and whether several calls may come in one reply.
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    # The legacy function-calling fields; refused when set.
    functions: Optional[list[Any]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None

    def requested_max_tokens(self) -> Optional[int]:
        # max_completion_tokens replaced max_tokens in OpenAI's chat API.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def field_for(self, param: Optional[str]) -> Optional[str]:
        return _CHAT_FIELDS.get(param, super().field_for(param))

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        self._check_messages()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got "
                                   f"{short_repr(self.top_logprobs)}", param="top_logprobs")
            if not self.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true",
                                   param="top_logprobs")
        self._check_unsupported()

    def _check_messages(self) -> None:
        if not self.messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise RequestError(f"messages.{i}.role must be one of {', '.join(CHAT_ROLES)}, got "
                                   f"{short_repr(message.role)}", param=f"messages.{i}.role")
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise RequestError(f"messages.{i}.content is required",
                                   param=f"messages.{i}.content")
            self._check_tool_calls(i, message)
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if part.type != "text" or part.text is None:
                        raise RequestError(
                            f"messages.{i}.content.{j}: only text content parts "
                            f"({{'type': 'text', 'text': ...}}) are supported",
                            param=f"messages.{i}.content")

    @staticmethod
    def _check_tool_calls(i: int, message: ChatMessage) -> None:
        if message.tool_calls is not None and message.role != "assistant":
            raise RequestError(f"messages.{i}.tool_calls is only allowed on assistant messages",
                               param=f"messages.{i}.tool_calls")
        for j, call in enumerate(message.tool_calls or []):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"messages.{i}.tool_calls.{j}.function.name is required",
                                   param=f"messages.{i}.tool_calls")
            if not isinstance(function.get("arguments", "{}"), (str, dict)):
                raise RequestError(f"messages.{i}.tool_calls.{j}.function.arguments must be a "
                                   "JSON string", param=f"messages.{i}.tool_calls")

    def _check_unsupported(self) -> None:
        if self.functions:
            raise RequestError("the legacy functions field is not supported: use tools",
                               param="functions")
        if self.function_call not in (None, "none"):
            raise RequestError("the legacy function_call field is not supported: use tool_choice",
                               param="function_call")

    def num_logprobs(self) -> Optional[int]:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools the chat template is given: none under tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tools

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: role and plain-text content, plus an
        assistant turn's tool calls (arguments as objects, which is what templates render
        with tojson) and a tool turn's tool_call_id."""
        turns = []
        for message in self.messages:
            # "developer" is OpenAI's newer name for the system role.
            role = "system" if message.role == "developer" else message.role
            turn: dict[str, Any] = {"role": role, "content": message.text()}
            if message.tool_calls:
                turn["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
            if message.tool_call_id is not None:
                turn["tool_call_id"] = message.tool_call_id
            if message.name is not None and role == "tool":
                turn["name"] = message.name
            turns.append(turn)
        return turns


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # rendered as the string it is
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function}


# Friendly messages for fields whose pydantic errors, one per union member,
# would read as noise.
_UNION_FIELD_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids, or a list of "
              "token id lists",
    "stop": "stop must be a string or a list of strings",
}


def _error_path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def request_error_from_validation(exc: ValidationError) -> RequestError:
    """Pydantic's first error as a 400 naming the field (OpenAI never answers 422)."""
    error = exc.errors(include_url=False)[0]
    loc = tuple(error.get("loc", ()))
    if not loc:
        return RequestError(f"invalid request: {error.get('msg', 'bad value')}")
    top = str(loc[0])
    if top in _UNION_FIELD_MESSAGES and error.get("type") != "missing":
        return RequestError(_UNION_FIELD_MESSAGES[top], param=top)
    if top == "messages" and len(loc) >= 3 and loc[2] == "content" and error.get("type") != "missing":
        path = f"messages.{loc[1]}.content"
        return RequestError(f"{path} must be a string or a list of text content parts", param=path)
    # Union members show up in the path as type names; drop them.
    path = _error_path(tuple(p for p in loc if not (isinstance(p, str) and "[" in p)))
    if error.get("type") == "missing":
        return RequestError(f"{path} is required", param=path)
    got = type(error.get("input")).__name__
    return RequestError(f"{path}: {error.get('msg', 'bad value')} (got {got})", param=path)


def validate_request(model: type[OpenAIModel], body: dict) -> OpenAIModel:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise request_error_from_validation(exc) from None


def ignored_fields(request: OpenAIModel) -> list[str]:
    """Fields the server does not know and ignores: top-level ones by name, nested ones by
    their path ("stream_options.foo", "messages[].foo"), each path once."""
    names: list[str] = []
    _collect_ignored(request, "", names)
    return sorted(dict.fromkeys(names))


def _collect_ignored(value: Any, prefix: str, names: list[str]) -> None:
    if isinstance(value, OpenAIModel):
        names.extend(prefix + key for key in (value.model_extra or {}))
        for field in type(value).model_fields:
            _collect_ignored(getattr(value, field), f"{prefix}{field}.", names)
    elif isinstance(value, list):
        for item in value:
            _collect_ignored(item, prefix[:-1] + "[].", names)


# ---- responses ----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first carries id, type and name; later ones only more
    arguments text, under the same index."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


class ChatDelta(BaseModel):
    """A delta carries only what changed: the role once, then content; unset keys are left out."""

    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rooflm"
    max_model_len: Optional[int] = None
    # vLLM's: a LoRA adapter's card names its path (root) and the base model (parent).
    root: Optional[str] = None
    parent: Optional[str] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
