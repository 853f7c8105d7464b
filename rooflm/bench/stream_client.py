"""One streamed request to an OpenAI-compatible endpoint, timed: what `rooflm bench serve` sends
and measures per request (rooflm/bench/serve.py), and what its client processes run
(rooflm/bench/client_pool.py). The request (SampleRequest), what it measured (RequestOutput), the
body it sends, and the SSE reading that times each token-carrying chunk.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Optional, Union

from rooflm.perf.serving_metrics import RequestOutput


@dataclass
class SampleRequest:
    """One request to send: a prompt (text, or token ids), its length in tokens, and max_tokens."""

    prompt: Union[str, list[int]]
    prompt_len: int
    output_len: int
    # Request fields of this request alone (priority, deadline_ms): merged into the body last.
    extra_body: Optional[dict] = None


def _is_chat(endpoint: str) -> bool:
    return "chat" in endpoint


def _payload(req: SampleRequest, model: str, endpoint: str, args: argparse.Namespace) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if _is_chat(endpoint):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM / rooflm extension: generate exactly max_tokens
    if req.extra_body:
        body.update(req.extra_body)
    return body


def _chunk_output(chunk: dict, chat: bool) -> tuple[str, bool]:
    """(text, whether the chunk carried output tokens).

    Text alone would miss tokens a server streams without text: a model
    without a tokenizer (token ids, empty text), or text held back until a
    multi-byte character completes. So a chunk carries tokens when it has
    text, token ids (vLLM's return_token_ids), or is an empty-text chunk that
    is neither the chat role announcement nor the closing finish_reason chunk.
    """
    choices = chunk.get("choices") or []
    if not choices:
        return "", False
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        empty_token = (delta.get("content") == "" and "role" not in delta
                       and not choice.get("finish_reason"))
        token_ids = choice.get("token_ids") or delta.get("token_ids")
    else:
        text = choice.get("text") or ""
        empty_token = choice.get("text") == "" and not choice.get("finish_reason")
        token_ids = choice.get("token_ids")
    return text, bool(text) or bool(token_ids) or empty_token


async def _sse_data(resp):
    """The data field of every server-sent event, as text.

    Split on "\n" only: line readers that also split on U+2028, U+2029 and NEL
    (httpx's aiter_lines()) would cut an event in two wherever a generated token
    holds one (JSON leaves them unescaped inside strings), and fail to parse it.
    """
    buffer = b""
    async for piece in resp.content.iter_any():
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line.startswith(b"data:"):  # skip blank separators, "event:" lines, comments
                yield line[len(b"data:"):].strip().decode("utf-8")
    line = buffer.rstrip(b"\r")
    if line.startswith(b"data:"):
        yield line[len(b"data:"):].strip().decode("utf-8")


def _error_message(body: str, status: int) -> str:
    """The server's own message when the body is an OpenAI error object, else the raw body."""
    text = body.strip()
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            err = parsed.get("error", parsed)
            if isinstance(err, dict) and "message" in err:
                text = str(err["message"])
            elif isinstance(err, str):
                text = err
            elif "detail" in parsed:
                text = str(parsed["detail"])
    except ValueError:
        pass
    return f"HTTP {status}: {text[:200]}" if text else f"HTTP {status}"


async def send_request(client, url: str, payload: dict, req: SampleRequest, bench_start: float,
                       chat: bool) -> RequestOutput:
    """Stream one request; never raises: every failure comes back as an unsuccessful output."""
    out = RequestOutput(prompt_len=req.prompt_len)
    sent = time.perf_counter()
    out.start = sent - bench_start
    last = sent
    chunks = 0
    usage_tokens = None
    text_parts = []
    try:
        async with client.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode("utf-8", errors="replace")
                out.error = _error_message(body, resp.status)
                out.latency = time.perf_counter() - sent
                return out
            async for data in _sse_data(resp):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    out.error = f"error in stream: {str(message)[:200]}"
                    out.latency = time.perf_counter() - sent
                    return out
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens"):
                        out.prompt_len = int(usage["prompt_tokens"])
                text, carries_tokens = _chunk_output(chunk, chat)
                if carries_tokens:
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - sent
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    out.chunk_times.append(now - bench_start)
                    text_parts.append(text)
        out.latency = time.perf_counter() - sent
    except Exception as exc:  # connection refused, timeouts, malformed JSON: all counted, none fatal
        out.error = f"{type(exc).__name__}: {str(exc)[:200]}" if str(exc) else type(exc).__name__
        out.latency = time.perf_counter() - sent
        return out
    if chunks == 0 and not usage_tokens:
        out.error = "stream ended without any output token"
        return out
    out.output_tokens = usage_tokens if usage_tokens is not None else chunks
    out.chunks = chunks
    if chunks == 0 or (chunks == 1 and out.output_tokens > 1):
        # Every token came in one chunk: its arrival is when the last token was ready, not
        # the first, so there is no first-token time to report.
        out.ttft = None
    out.generated_text = "".join(text_parts)
    out.success = True
    return out
