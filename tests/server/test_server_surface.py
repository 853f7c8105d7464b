"""The server's surface around generation, against a real `rooflm serve`: X-Request-Id, /tokenize,
/detokenize, /version, unsupported endpoints, --chat-template, and the Grafana dashboard's queries.
(The Responses API has its own file, test_responses.py.)"""

import concurrent.futures
import importlib.metadata
import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import rooflm
from tests.server.server_utils import (API_KEY, MODEL, REPO_ROOT, SMALL_ENGINE_ARGS,
                                       assert_openai_error, start_server)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
HEX_ID = re.compile(r"[0-9a-f]{32}")


def _post(server, auth, path, body, headers=None, timeout=60):
    return httpx.post(server.url + path, headers={**auth, **(headers or {})}, json=body,
                      timeout=timeout)


# ---- X-Request-Id -------------------------------------------------------------------------------------


def test_request_id_is_echoed_and_names_the_response(server, auth):
    out = _post(server, auth, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION,
                                                       "max_tokens": 2},
                headers={"X-Request-Id": "trace-abc.123"})
    assert out.status_code == 200
    assert out.headers["x-request-id"] == "trace-abc.123"
    assert out.json()["id"].startswith("chatcmpl-trace-abc.123-")


def test_request_id_is_generated_when_absent(server, auth):
    first = _post(server, auth, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    second = _post(server, auth, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
    assert all(HEX_ID.fullmatch(i) for i in ids) and ids[0] != ids[1]
    assert first.json()["id"] == f"cmpl-{ids[0]}"


def test_request_id_on_errors_and_streams(server, auth):
    unauthorized = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "t-401"})
    assert unauthorized.status_code == 401 and unauthorized.headers["x-request-id"] == "t-401"
    bad = _post(server, auth, "/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 0},
                headers={"X-Request-Id": "t-400"})
    assert_openai_error(bad, 400)
    assert bad.headers["x-request-id"] == "t-400"
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      headers={**auth, "X-Request-Id": "t-stream"},
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 2,
                            "stream": True}) as stream:
        assert stream.status_code == 200 and stream.headers["x-request-id"] == "t-stream"
        assert "data: [DONE]" in stream.read().decode()


def test_a_reused_request_id_does_not_collide(server, auth):
    # Two requests in flight with one id: both are served (the engine ids stay unique).
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 4, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: _post(server, auth, "/v1/completions", body,
                                             headers={"X-Request-Id": "same-id"}), range(2)))
    assert [o.status_code for o in outs] == [200, 200]
    assert outs[0].json()["id"] != outs[1].json()["id"]
    assert all(o.headers["x-request-id"] == "same-id" for o in outs)


def test_an_unusable_request_id_is_a_400_under_a_fresh_id(server, auth):
    out = _post(server, auth, "/v1/completions", {"model": MODEL, "prompt": "Hi"},
                headers={"X-Request-Id": "x" * 129})
    error = assert_openai_error(out, 400)
    assert error["param"] == "X-Request-Id" and "128" in error["message"]
    assert HEX_ID.fullmatch(out.headers["x-request-id"])


def test_request_id_reaches_the_log(server, auth):
    out = _post(server, auth, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                 "surely_unknown_field": 1},
                headers={"X-Request-Id": "trace-in-log-77"})
    assert out.status_code == 200
    assert "request trace-in-log-77: ignoring unknown request fields: surely_unknown_field" in \
        server.log_tail(20000)


# ---- /tokenize, /detokenize, /version ----------------------------------------------------------------


def test_tokenize_a_prompt_counts_what_a_completion_costs(server, auth):
    prompt = "The capital of France is"
    out = _post(server, auth, "/tokenize", {"model": MODEL, "prompt": prompt,
                                            "return_token_strs": True})
    assert out.status_code == 200, out.text
    body = out.json()
    completion = _post(server, auth, "/v1/completions",
                       {"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
    assert body["count"] == len(body["tokens"]) == completion["usage"]["prompt_tokens"]
    assert body["max_model_len"] == 512
    assert len(body["token_strs"]) == body["count"] and body["token_strs"][0] == "The"
    plain = _post(server, auth, "/tokenize", {"prompt": prompt}).json()  # model is optional
    assert plain["tokens"] == body["tokens"] and "token_strs" not in plain


def test_tokenize_messages_counts_what_a_chat_costs(server, auth):
    out = _post(server, auth, "/tokenize", {"model": MODEL, "messages": QUESTION,
                                            "add_generation_prompt": True})
    assert out.status_code == 200, out.text
    chat = _post(server, auth, "/v1/chat/completions",
                 {"model": MODEL, "messages": QUESTION, "max_tokens": 1}).json()
    assert out.json()["count"] == chat["usage"]["prompt_tokens"]
    without = _post(server, auth, "/tokenize", {"messages": QUESTION,
                                                "add_generation_prompt": False}).json()
    assert without["count"] < out.json()["count"]  # the assistant header is left out


def test_detokenize_round_trips(server, auth):
    text = "Hello world, 42!"
    tokens = _post(server, auth, "/tokenize", {"prompt": text}).json()["tokens"]
    out = _post(server, auth, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert out.status_code == 200 and out.json() == {"prompt": text}


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
])
def test_tokenize_bad_input_is_a_400_naming_the_field(server, auth, path, body, param):
    error = assert_openai_error(_post(server, auth, path, body), 400)
    assert error["param"] == param, error


def test_tokenize_another_model_is_a_404(server, auth):
    error = assert_openai_error(_post(server, auth, "/tokenize", {"model": "gpt-4", "prompt": "x"}),
                                404)
    assert error["param"] == "model"


def test_version(server, auth):
    out = httpx.get(server.url + "/version", headers=auth)
    assert out.status_code == 200
    assert out.json() == {"version": rooflm.__version__}
    assert rooflm.__version__ == importlib.metadata.version("rooflm")


# ---- endpoints rooflm does not serve ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/moderations", "/v1/audio/speech",
                                  "/v1/audio/transcriptions", "/v1/images/generations",
                                  "/v1/no/such/thing"])
def test_unsupported_endpoints_are_named_in_a_404(server, auth, path):
    error = assert_openai_error(_post(server, auth, path, {"model": MODEL, "input": "x"}), 404)
    assert error["message"] == f"{path} is not supported by rooflm"
    assert error["code"] == "unsupported_endpoint"


def test_the_openai_client_sees_embeddings_as_not_found(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError, match="/v1/embeddings is not supported by rooflm"):
        client.embeddings.create(model=MODEL, input="hello")


def test_a_wrong_method_is_a_405_in_the_same_shape(server, auth):
    out = httpx.get(server.url + "/v1/chat/completions", headers=auth)
    error = assert_openai_error(out, 405)
    assert error["message"] == "GET is not allowed on /v1/chat/completions; use POST"
    assert out.headers["allow"] == "POST"


# ---- the Grafana dashboard ------------------------------------------------------------------------------


def _exported_names(url: str) -> set[str]:
    """Every series name /metrics exports or declares (a gauge without samples yet, as
    rooflm:mbu without a known peak, is declared)."""
    names = set()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        elif family.type == "counter":
            names.add(family.name + "_total")
    return names


def test_the_dashboard_queries_only_series_we_export(server):
    dashboard = json.loads((REPO_ROOT / "examples" / "grafana-dashboard.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.update(re.findall(r"(?:vllm|rooflm):[a-z0-9_]+", target["expr"]))
    exported = _exported_names(server.url)
    assert queried - exported == set()
    # vLLM's five per-request series and rooflm's own are on it.
    for name in ("vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                 "vllm:request_max_num_generation_tokens_bucket",
                 "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                 "rooflm:mbu", "rooflm:step_time_seconds_bucket", "rooflm:kv_free_blocks"):
        assert name in queried, name


# ---- --chat-template ------------------------------------------------------------------------------------

# A tool-aware template in the Hermes/Qwen family: tools listed up front, calls as <tool_call>.
# ("{{ nl }}": the template engine's trim_blocks drops a newline right after a block tag.)
TEMPLATE = ("{% set nl = '\\n' %}{% if tools %}<<tools>>{% for t in tools %}{{ t['function']['name'] }};"
            "{% endfor %}{{ nl }}{% endif %}{% for m in messages %}<<{{ m['role'] }}>>"
            "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
            "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ nl }}{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.fixture(scope="module")
def templated_server(tmp_path_factory):
    process = start_server(tmp_path_factory.mktemp("templated"), "templated",
                           SMALL_ENGINE_ARGS + ["--chat-template", TEMPLATE])
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_chat_template_inline_replaces_the_models(templated_server):
    url = templated_server.url
    tokens = httpx.post(url + "/tokenize", json={"messages": QUESTION}, timeout=30).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text == "<<user>>What is the capital of France?\n<<assistant>>"
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 1})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(tokens)


def test_tools_and_tool_turns_reach_a_servers_template(templated_server):
    url = templated_server.url
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    tokens = httpx.post(url + "/tokenize", timeout=30,
                        json={"messages": messages, "tools": [tool]}).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text == ("<<tools>>get_weather;\n<<user>>What is the capital of France?\n"
                    "<<assistant>><tool_call>get_weather</tool_call>\n<<tool>>21 C\n<<assistant>>")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool], max_tokens=1)
    assert chat.usage.prompt_tokens == len(tokens)
    answer = client.responses.create(model=MODEL, tools=[{"type": "function", **tool["function"]}],
                                     max_output_tokens=1, input=[
        QUESTION[0], {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                      "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}])
    assert answer.usage.input_tokens == len(tokens)
    # tool_choice "none": the tools stay out of the template.
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[tool],
                                          tool_choice="none", max_tokens=1)
    plain = httpx.post(url + "/tokenize", json={"messages": QUESTION}, timeout=30).json()["count"]
    assert chat.usage.prompt_tokens == plain


def _serve_fails(args: list[str]) -> str:
    """`rooflm serve` with args must exit 1 before loading a model; returns its stderr."""
    out = subprocess.run([sys.executable, "-m", "rooflm", "serve", "--port", "1", *args],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]
    return out.stderr


def test_a_broken_chat_template_stops_serve_at_start_up(tmp_path):
    assert "does not compile" in _serve_fails(["--chat-template", "{% for m in messages %}"])
    missing = tmp_path / "nope.jinja"
    assert "does not exist" in _serve_fails(["--chat-template", str(missing)])


def test_a_chat_template_file_is_read(tmp_path):
    from rooflm.server.chat_template import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE  # inline


@pytest.mark.parametrize("template,words", [
    ("{{ raise_exception('needs a system turn') }}", "fails on a sample conversation"),
    ("{% for m in messages %}<turn>{% endfor %}", "does not render the messages' content"),
])
def test_a_chat_template_that_cannot_render_is_refused(template, words):
    from rooflm.model.loader import resolve_model
    from rooflm.server.chat_template import ChatTemplateError, install_chat_template
    from rooflm.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model(None, "auto")[0], "auto")
    with pytest.raises(ChatTemplateError, match=words):
        install_chat_template(tokenizer, template)
    install_chat_template(tokenizer, TEMPLATE)
    assert tokenizer.apply_chat_template(QUESTION) == (
        "<<user>>What is the capital of France?\n<<assistant>>")
