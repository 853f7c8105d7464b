"""Errors that cross the engine's face, and the one a model loader raises.

InvalidRequest is the one way the engine and SamplingParams refuse a request as
given: nothing was queued, and the caller can fix it. `param` names the field
at fault in the OpenAI API's vocabulary ("prompt", "max_tokens", "temperature",
...), so the server fills in OpenAI's error `param` from it without reading the
message. The server then names the field the client actually sent where the
two differ (a chat request's max_completion_tokens, or messages for its prompt).

It is a ValueError, so callers written against "bad input raises ValueError"
keep working.
"""

from __future__ import annotations

from typing import Optional


class InvalidRequest(ValueError):
    """A request refused as given. param: the request field at fault, or None."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(ValueError):
    """A checkpoint could not be used; the message names the file and the problem. Every loader
    (safetensors, GGUF, quantized checkpoints) raises it, so they need not import each other."""


def load_error(path: str, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {problem}")
