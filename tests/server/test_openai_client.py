"""The official openai client against a real `rooflm serve`: what SDK users see.

Generations stay a few tokens long; the model is SmolLM2-135M-Instruct on the CPU.
"""

import uuid

import openai
import pytest

from tests.server.server_utils import API_KEY, MODEL

# A real server process: the real model, bounded in time even without --timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models(client):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_greedy_and_usage(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.text.startswith(" Paris")
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 4
    assert out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 9
    assert out.usage.prompt_tokens_details.cached_tokens in (0, 16)  # whole blocks of 16 only


def test_completion_stream_equals_non_stream_for_a_seed(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=1234)
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(stream=True, **args))
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert streamed == whole.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.finish_reason]


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    args = dict(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0.8, seed=7)
    whole = client.chat.completions.create(**args)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")


def test_n_samples(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0,
                                    seed=3, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, n=3, seed=5)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_list_of_prompts_and_token_ids(client):
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=2, n=2,
                                    temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: both samples of prompt 0 agree
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=2)
    assert ids.usage.prompt_tokens == 3
    batch = client.completions.create(model=MODEL, prompt=[[504, 3575], [1, 2, 3]], max_tokens=1)
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 5


def test_stop_string(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    stop=["."])
    assert out.choices[0].text == " Paris"
    assert out.choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=42)
    first = client.completions.create(**args).choices[0].text
    second = client.completions.create(**args).choices[0].text
    assert first == second


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert 1 <= len(top) <= 3
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the top token
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                       echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text.startswith(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None  # nothing scores the first prompt token
    assert len(choice.logprobs.tokens) == 5 + 2


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_prefix_cache_hits_and_cache_salt(client):
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    salt = uuid.uuid4().hex
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"cache_salt": salt})
    # A new salt shares no cached blocks with anything before it.
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                            extra_body={"cache_salt": salt})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached <= second.usage.prompt_tokens
    other_tenant = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                  extra_body={"cache_salt": uuid.uuid4().hex})
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0


def test_unknown_fields_are_ignored(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, user="someone",
                                    extra_body={"not_a_field": {"nested": [1, 2]}})
    assert len(out.choices) == 1


def test_client_errors(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=5)
    assert bad.value.param == "temperature"
    assert "[0.0, 2.0]" in bad.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt=[1] * 500, max_tokens=100)
    assert too_long.value.param == "max_tokens"
    assert all(str(n) in too_long.value.message for n in (500, 100, 512))
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1)
    assert missing.value.code == "model_not_found"
    stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
