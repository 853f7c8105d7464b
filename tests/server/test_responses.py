"""POST /v1/responses against a real `rooflm serve`, through the official openai client
(client.responses.create, streamed and not) and raw HTTP for what the client hides."""

import httpx
import openai
import pytest

from tests.server.server_utils import API_KEY, MODEL, assert_openai_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done",
              "response.output_item.done"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _tokens(server, auth, messages) -> int:
    out = httpx.post(server.url + "/tokenize", headers=auth, timeout=30,
                     json={"messages": messages})
    return out.json()["count"]


def test_text_input_with_instructions(client, server, auth):
    out = client.responses.create(model=MODEL, input="What is the capital of France?",
                                  instructions="Answer in one word.", max_output_tokens=5,
                                  temperature=0)
    assert out.object == "response" and out.model == MODEL and out.id.startswith("resp_")
    assert out.output_text and out.output[0].role == "assistant"
    assert out.instructions == "Answer in one word." and out.max_output_tokens == 5
    # The instructions are the system turn: the prompt is exactly that conversation.
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    assert out.usage.input_tokens == _tokens(server, auth, messages)
    assert 1 <= out.usage.output_tokens <= 5
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    # A response cut at max_output_tokens is incomplete, as OpenAI reports it.
    if out.usage.output_tokens == 5:
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None
    assert out.store is False


def test_message_list_input_is_the_chat_conversation(client, server, auth):
    turns = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
             {"role": "user", "content": "Another?"}]
    out = client.responses.create(model=MODEL, input=turns, max_output_tokens=3, temperature=0)
    expected = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]
    assert out.usage.input_tokens == _tokens(server, auth, expected)


def test_greedy_matches_chat_completions(client):
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6,
                                       temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "Say hello."}])
    assert response.output_text == chat.choices[0].message.content


def test_streamed_events(client):
    stream = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6,
                                     temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_ORDER
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):-1] == STREAM_END
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(d.delta for d in deltas)
    assert events[4 + len(deltas)].text == text == final.output_text
    assert final.usage.output_tokens <= 6
    # The same greedy text as the one-shot answer.
    once = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6,
                                   temperature=0)
    assert once.output_text == text


@pytest.mark.parametrize("extra,param,words", [
    ({"store": True}, "store", "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools", "tools.0.name is required"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "not in tools"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"temperature": 3.0}, "temperature", "temperature"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format must be"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
     "text.format", "does not compile"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type", "only messages"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content", "only text parts"),
    ({"input": []}, "input", "non-empty"),
])
def test_refusals_name_the_field(server, auth, extra, param, words):
    body = {"model": MODEL, "input": "Hi", **extra}
    error = assert_openai_error(httpx.post(server.url + "/v1/responses", headers=auth, json=body,
                                           timeout=30), 400)
    assert error["param"] == param and words in error["message"], error


def test_the_openai_client_gets_a_bad_request_for_store(client):
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model=MODEL, input="Hi", store=True)


def test_a_too_long_input_names_input(server, auth):
    body = {"model": MODEL, "input": "word " * 600}
    error = assert_openai_error(httpx.post(server.url + "/v1/responses", headers=auth, json=body,
                                           timeout=30), 400)
    assert error["param"] == "input", error
