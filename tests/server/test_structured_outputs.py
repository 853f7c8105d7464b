"""Structured outputs, tool calling and logit_bias through the official openai client, unchanged,
against a real `rooflm serve` with SmolLM2-135M-Instruct on the CPU.

Constrained generations stay short (schemas with bounded strings and numbers), so each test is
bounded in time; the schema test still covers 32 samples over 8 seeds.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.server.server_utils import API_KEY, MODEL, SMALL_ENGINE_ARGS, start_server
from tests.unit.test_structured import LARK_SQL  # vLLM's documentation example

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# What a Hermes/Qwen-family model writes to call a tool; forced below with a regex, so that
# the "auto" parser is tested on the real server whatever the 135M model would choose.
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def structured_server(tmp_path_factory):
    """A server of this module's own: the main server's 120 s request timeout and 1024 tokens in
    flight are tight for 4 constrained samples a request on a loaded 2-core machine."""
    process = start_server(tmp_path_factory.mktemp("structured"), "structured", SMALL_ENGINE_ARGS + [
        "--api-key", API_KEY, "--request-timeout", "900", "--max-tokens-in-flight", "4096"])
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(structured_server):
    return openai.OpenAI(base_url=f"{structured_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=900)


def test_json_schema_output_always_parses_and_validates(client):
    def ask(seed):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            temperature=1.0, seed=seed, n=4, max_tokens=80)

    # All 4 at once: the engine batches their 16 samples, which a loaded CPU needs.
    with ThreadPoolExecutor(max_workers=4) as pool:
        replies = list(pool.map(ask, range(4)))
    texts = []
    for reply in replies:
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            texts.append(choice.message.content)
    assert len(texts) == 16
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1  # sampled, not one answer forced 16 times


def test_json_schema_streamed_equals_whole(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


def test_json_object_mode(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Reply with this JSON object: {\"ok\": true}"}],
            response_format={"type": "json_object"}, temperature=0.7, seed=seed, max_tokens=150)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict)


def test_vllm_extras_regex_and_choice_on_completions(client):
    out = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20,
                                    temperature=1.0, seed=3, n=3,
                                    extra_body={"guided_regex": r"\d{3}-\d{4}"})
    for choice in out.choices:
        assert re.fullmatch(r"\d{3}-\d{4}", choice.text), choice.text
        assert choice.finish_reason == "stop"
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=5,
        temperature=1.0, seed=5, n=4, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.message.content for c in out.choices} <= {"yes", "no"}


def test_lark_grammar_as_vllm_takes_it(client):
    out = client.completions.create(model=MODEL, prompt="SQL that lists the users' names:",
                                    max_tokens=24, temperature=1.0, seed=1, n=2,
                                    extra_body={"structured_outputs": {"grammar": LARK_SQL}})
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert re.fullmatch(r"SELECT \w+(,\w+)* FROM \w+", choice.text), choice.text
        else:  # an identifier may run to max_tokens; what came is still the grammar's prefix
            assert re.fullmatch(r"SELECT \w+(,\w+)*( FROM \w*)?|SELECT \w*", choice.text), choice.text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"guided_grammar": 'start: "a" ('})
    assert "read as Lark" in err.value.message and err.value.body["param"] == "guided_grammar"


def test_stop_string_ends_a_constrained_output(client):
    out = client.completions.create(model=MODEL, prompt="Count:", max_tokens=20, temperature=0,
                                    stop=["3"], extra_body={"guided_regex": r"1 2 3 4 5"})
    assert out.choices[0].text == "1 2 " and out.choices[0].finish_reason == "stop"


def test_tool_choice_required_gives_parsable_calls_streamed_in_fragments(client):
    args = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice="required", parallel_tool_calls=False, temperature=0.7, seed=2,
                max_tokens=80)
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    name, arguments = call.function.name, json.loads(call.function.arguments)
    assert name in ("get_weather", "get_time")
    schema = (WEATHER_TOOL if name == "get_weather" else TIME_TOOL)["function"]["parameters"]
    jsonschema.validate(arguments, schema)
    assert call.id and call.type == "function"
    # Streamed, same seed: the name first, then the arguments in fragments (not one whole call
    # at the end), joining to exactly the arguments of the whole reply.
    chunks = list(client.chat.completions.create(stream=True, **args))
    calls, finish = _collect_stream(chunks)
    assert finish == "tool_calls" and len(calls) == 1
    assert (calls[0].function.name, calls[0].function.arguments) == (name, call.function.arguments)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == name
    assert sum(1 for d in deltas[1:] if d.function.arguments) >= 3


def test_named_tool_choice_streams_the_arguments(client):
    args = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(whole.message.tool_calls[0].function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
    calls, finish = _collect_stream(client.chat.completions.create(stream=True, **args))
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    assert calls[0].function.arguments == whole.message.tool_calls[0].function.arguments


def test_tool_choice_auto_parses_a_hermes_call(client):
    # The regex fixes the text, not its tokens: a model may spell it in many short tokens (the
    # default model's int4 CPU weights took more than 60), so max_tokens leaves room for that.
    args = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="auto",
                temperature=0, max_tokens=200,
                extra_body={"guided_regex": HERMES_CALL.replace("{", r"\{").replace("}", r"\}")})
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    chunks = list(client.chat.completions.create(stream=True, **args))
    calls, finish = _collect_stream(chunks)
    assert finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", call.function.arguments)]
    fragments = [d.function.arguments for c in chunks if c.choices
                 for d in c.choices[0].delta.tool_calls or [] if d.function.arguments]
    assert len(fragments) >= 3  # the arguments streamed as the model wrote them


def test_tool_choice_auto_without_a_call_is_plain_content(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                           tool_choice="auto", temperature=0, max_tokens=8,
                                           extra_body={"guided_choice": ["It is sunny."]})
    choice = reply.choices[0]
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_tool_choice_none_and_auto_without_tools_are_accepted(client):
    for tool_choice in ("none", "auto"):
        reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=3,
                                               temperature=0, tool_choice=tool_choice)
        assert reply.choices[0].message.content


def test_replayed_tool_conversation(client):
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                           temperature=0, max_tokens=12)
    assert reply.choices[0].message.content
    question_only = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER,
                                                   tools=[WEATHER_TOOL], temperature=0, max_tokens=1)
    # The tool's answer (and the template's turns around it) reached the prompt.
    assert reply.usage.prompt_tokens >= question_only.usage.prompt_tokens + 15


# SmolLM2's id of " Paris": the force case below proves it, by producing it four times.
PARIS = 7042


def test_logit_bias_forces_and_bans_tokens(client):
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert base.choices[0].text == " Paris"
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0,
                                       seed=1, logit_bias={str(PARIS): 100})
    assert forced.choices[0].text == " Paris" * 4
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(PARIS): -100})
    assert banned.choices[0].text != " Paris"
    streamed = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, temperature=0,
        logit_bias={str(PARIS): 100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == " Paris" * 3


# ---- function tools in /v1/responses (this module's server: constrained generation is slow on a
# loaded CPU) -------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 16},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}
ASK = "What is the weather in Paris?"


def test_responses_required_tool_call_is_a_function_call_item(client):
    args = dict(model=MODEL, input=ASK, tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    out = client.responses.create(**args)
    assert out.status == "completed"
    [call] = out.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    schema = (WEATHER if call.name == "get_weather" else TIME)["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert out.tool_choice == "required" and [t.name for t in out.tools] == ["get_weather", "get_time"]
    # Streamed: the same call, as one function_call item.
    events = list(client.responses.create(stream=True, **args))
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.type, done.name, done.arguments) == ("function_call", call.name, call.arguments)


def test_responses_named_tool_call_streams_its_arguments(client):
    args = dict(model=MODEL, input=ASK, tools=[WEATHER, TIME],
                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                max_output_tokens=60)
    whole = client.responses.create(**args)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 3  # fragments as the model writes them, not one piece at the end
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * len(deltas)
                     + ["response.function_call_arguments.done", "response.output_item.done",
                        "response.completed"])
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "get_weather" and added.arguments == ""
    assert {d.item_id for d in deltas} == {added.id} and {d.output_index for d in deltas} == {0}
    arguments = "".join(d.delta for d in deltas)
    assert arguments == events[-3].arguments == done.arguments == call.arguments
    assert events[-1].response.output[0].arguments == arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    out = client.responses.create(model=MODEL, input=ASK, max_output_tokens=30, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "weather",
                                                   "schema": schema, "strict": True}})
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), schema)


def test_responses_replayed_tool_conversation(client, structured_server, auth):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}'}
    answer = {"type": "function_call_output", "call_id": "call_1",
              "output": '{"temperature": 21, "sky": "clear"}'}
    out = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, call, answer],
                                  tools=[WEATHER], tool_choice="none", temperature=0,
                                  max_output_tokens=8)
    assert out.output[0].type == "message" and out.output_text
    # The prompt is the chat conversation: the call as an assistant turn, the output as a tool turn.
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": answer["output"]}]
    assert out.usage.input_tokens == _tokens(structured_server, auth, messages)
    assert out.usage.input_tokens >= _tokens(structured_server, auth, messages[:1]) + 15


def _tokens(server, auth, messages) -> int:
    out = httpx.post(server.url + "/tokenize", headers=auth, timeout=60, json={"messages": messages})
    return out.json()["count"]


def _collect_stream(chunks):
    """Tool calls assembled from streamed deltas, as an SDK user assembles them."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "type": None, "name": "", "arguments": ""})
            entry["id"] = delta.id or entry["id"]
            entry["type"] = delta.type or entry["type"]
            if delta.function is not None:
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish

    class Function:
        def __init__(self, name, arguments):
            self.name, self.arguments = name, arguments

    class Call:
        def __init__(self, entry):
            self.id, self.type = entry["id"], entry["type"]
            self.function = Function(entry["name"], entry["arguments"])

    return [Call(calls[i]) for i in sorted(calls)], finish
