"""How one request wants its tokens sampled and when it wants them to stop.

User-facing: every value is checked at construction, so a bad request fails
in the server with a message naming the field, never inside the engine's step.
A bad value raises InvalidRequest (a ValueError) whose `param` is the field.
Semantics follow vLLM / the OpenAI API.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional, Union

from rooflm.errors import InvalidRequest

# vLLM's and OpenAI's cap on the number of alternatives returned per position.
MAX_LOGPROBS = 20

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing the logits by it would
# overflow them to inf. SamplingParams.greedy is the one place that decides; the sampler, the
# speculative paths and the server ask it, so every path divides only by temperatures >= this.
GREEDY_TEMPERATURE_EPS = 1e-5

# torch.Generator.manual_seed accepts any value that fits a signed or an
# unsigned 64-bit integer.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _is_int(value) -> bool:
    # bool is a subclass of int; True as a token count is a client bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(
    name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = None
) -> None:
    if not _is_int(value):
        raise InvalidRequest(f"{name} must be an integer, got {value!r} ({type(value).__name__})",
                             param=name)
    if minimum is not None and maximum is not None and not (minimum <= value <= maximum):
        raise InvalidRequest(f"{name} must be in [{minimum}, {maximum}], got {value}", param=name)
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"{name} must be >= {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise InvalidRequest(f"{name} must be <= {maximum}, got {value}", param=name)


def _check_float(name: str, value) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r} ({type(value).__name__})",
                             param=name)
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be finite, got {value}", param=name)
    return value


# OpenAI's range for a logit_bias value: -100 bans a token, +100 all but forces it.
LOGIT_BIAS_LIMIT = 100.0


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate: exactly one of the fields is set.

    vLLM's StructuredOutputsParams under the same names. The engine compiles it into a
    grammar (rooflm/structured/) and masks every sampled token to the grammar's next
    allowed tokens. `json` is a JSON schema as JSON text: the text
    is the grammar cache's key, and it crosses the process boundary as a string. Keys keep
    their order: a schema's property order is the order the object is generated in.
    """

    json: Optional[str] = None  # a JSON schema (a dict is serialized at construction)
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    regex: Optional[str] = None
    choice: Optional[list[str]] = None  # one of these strings, verbatim
    grammar: Optional[str] = None  # EBNF (xgrammar's / llama.cpp's GBNF dialect) or Lark
    # The request field the constraint came from, so that a grammar that does not compile
    # is a 400 naming what the client sent (response_format, guided_json, tool_choice, ...).
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, list, bool)):
            self.json = json.dumps(self.json)
        kinds = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise InvalidRequest("structured outputs take exactly one of json, json_object, regex, "
                                 f"choice, grammar; got {kinds or 'none'}", param=self.param)
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"{name} must be a non-empty string", param=self.param)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequest("choice must be a non-empty list of non-empty strings",
                                     param=self.param)
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        raise AssertionError("checked at construction")

    @property
    def key(self) -> tuple[str, str]:
        """What the grammar cache is keyed by: equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, getattr(self, kind)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a bool, got {value!r} ({type(value).__name__})",
                             param=name)


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request."""

    # How many independent samples to return for the prompt.
    n: int = 1

    # The distribution: temperature 0 (any below GREEDY_TEMPERATURE_EPS) means greedy
    # (argmax). top_k 0 or -1 disables top-k; top_p 1 disables nucleus sampling; min_p
    # drops tokens whose probability is below min_p times the most likely token's.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    # Penalties. presence/frequency (OpenAI) subtract from the logits of
    # tokens already generated; repetition (HF/CTRL) scales the logits of
    # tokens seen in the prompt or the output, > 1 discourages them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    # A seed makes the request reproducible whatever else is in the batch.
    seed: Optional[int] = None

    # Length: max_tokens None means up to the context length. EOS and
    # stop_token_ids cannot end the sequence before min_tokens are generated.
    max_tokens: Optional[int] = 16
    min_tokens: int = 0

    # Stopping. stop strings are matched on the detokenized text, across token
    # boundaries; both lists are normalised to lists (empty when None).
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    # Logprobs: the number of top alternatives returned with each sampled
    # (logprobs) or prompt (prompt_logprobs) token; 0 returns only the chosen
    # token's own logprob, None returns nothing.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    # Detokenization.
    skip_special_tokens: bool = True

    # Added to the logits of these token ids before sampling (OpenAI's logit_bias): values
    # in [-100, 100]. The engine checks the ids against its vocabulary.
    logit_bias: Optional[dict[int, float]] = None

    # A grammar the output must follow (JSON schema, regex, choice, EBNF); None: free text.
    structured_outputs: Optional[StructuredOutputsParams] = None

    # "delta": the engine returns a RequestOutput every step the request gets tokens (for
    # streaming); "final": only when it finishes. Offline batches take "final": building an
    # output per request per step costs the host microseconds that add up at hundreds of
    # running requests (vLLM's RequestOutputKind.FINAL_ONLY).
    output_kind: str = "delta"

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        if self.output_kind not in ("delta", "final"):
            raise InvalidRequest(f"output_kind must be 'delta' or 'final', got {self.output_kind!r}",
                                 param="output_kind")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}",
                                 param="temperature")

        self.top_p = _check_float("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")

        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}",
                                 param="top_k")

        self.min_p = _check_float("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not (-2.0 <= value <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", param=name)
            setattr(self, name, value)

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                                 param="repetition_penalty")

        if self.seed is not None:
            _check_int("seed", self.seed, minimum=_SEED_MIN, maximum=_SEED_MAX)

        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                param="min_tokens",
            )

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0, maximum=MAX_LOGPROBS)

        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise InvalidRequest("structured_outputs must be a StructuredOutputsParams",
                                 param="structured_outputs")

    @staticmethod
    def _normalise_logit_bias(bias) -> Optional[dict[int, float]]:
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise InvalidRequest(f"logit_bias must map token ids to numbers, got "
                                 f"{type(bias).__name__}", param="logit_bias")
        out = {}
        for token_id, value in bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0), got "
                                     f"{token_id!r}", param="logit_bias")
            value = _check_float("logit_bias", value)
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {value} for "
                                     f"token {token_id}", param="logit_bias")
            out[token_id] = value
        return out

    @staticmethod
    def _normalise_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise InvalidRequest(
                f"stop must be a string or a list of strings, got {type(stop).__name__}", param="stop"
            )
        for item in stop:
            if not isinstance(item, str):
                raise InvalidRequest(f"stop must contain only strings, got {item!r}", param="stop")
            if item == "":
                raise InvalidRequest("stop must not contain empty strings", param="stop")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(stop_token_ids) -> list[int]:
        if stop_token_ids is None:
            return []
        if not isinstance(stop_token_ids, (list, tuple)):
            raise InvalidRequest(
                f"stop_token_ids must be a list of integers, got {type(stop_token_ids).__name__}",
                param="stop_token_ids",
            )
        for token_id in stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequest(
                    f"stop_token_ids must contain integers >= 0, got {token_id!r}",
                    param="stop_token_ids",
                )
        return list(stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Argmax: a temperature too small to divide by, or a top-k of one."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1


def resolve_max_tokens(max_tokens: Optional[int], prompt_len: int, max_model_len: int) -> int:
    """The number of tokens a request may generate: max_tokens, or (None) up to the context
    length. Raises InvalidRequest when the prompt and max_tokens do not fit the context.

    The one copy of this rule: the engine applies it in add_request, and the server
    before admission, where a request that can never fit must be a 400 naming the
    field rather than a 429 about the tokens it would reserve.
    """
    if prompt_len >= max_model_len:
        raise InvalidRequest(f"prompt has {prompt_len} tokens, but the context length is "
                             f"{max_model_len}: it must be shorter", param="prompt")
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise InvalidRequest(f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                             f"{prompt_len + max_tokens}, over the context length of "
                             f"{max_model_len}", param="max_tokens")
    return max_tokens
