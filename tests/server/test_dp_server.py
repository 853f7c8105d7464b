"""`rooflm serve --data-parallel-size 2` on a tiny random model, through the real `openai` client.

Two engine cores behind one API process: greedy outputs equal one engine's; the
cache-aware router keeps prompts that share a long prefix on one replica (its
prefix-cache hits show it, per replica, in /metrics) and spreads a burst of
unrelated prompts by load; killing one core makes /health name it (503), and stopping the server leaves no
core behind. The tiny model gets a word-level tokenizer ("w3" .. "w255" are ids
3 .. 255) so that prompts and outputs are text.
"""

import os
import signal
import time

import httpx
import pytest

from rooflm.llm import LLM
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model_with_tokenizer
from tests.server.server_utils import pid_gone, scrape, start_server

pytestmark = pytest.mark.timeout(240)

SHARED = " ".join(f"w{i}" for i in range(10, 74))  # 64 tokens: 4 blocks of 16
QUESTIONS = [" ".join(f"w{200 + 7 * q + i}" for i in range(5)) for q in range(4)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-dp"))


def _args(model: str, routing: str) -> list[str]:
    return ["--model", model, "--device", "cpu", "--dtype", "float32", "--num-blocks", "64",
            "--served-model-name", "tiny", "--log-interval", "0", "--disable-log-requests",
            "--data-parallel-size", "2", "--dp-routing", routing, "--keep-running-on-error",
            # A killed replica stays down here; its restart is test_engine_restart's.
            "--no-engine-restart"]


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    # One server (each costs an API process and two cores, seconds of CI CPU): round-robin's
    # alternation is the router's unit test (tests/unit/test_dp_router.py).
    process = start_server(tmp_path_factory.mktemp("dp"), "dp", _args(model, "cache_aware"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _complete(url: str, prompts: list[str]) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    texts = []
    for prompt in prompts:  # one at a time: each is routed with the others finished
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
        texts.append(out.choices[0].text)
    return texts


def _per_engine(samples: dict, name: str, **wanted) -> dict[str, float]:
    found = {}
    for (sample, labels), value in samples.items():
        labels = dict(labels)
        if sample == name and all(labels.get(k) == v for k, v in wanted.items()):
            found[labels["engine"]] = value
    return found


def _core_pids(server_pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == server_pid and spawned:
            pids.append(int(entry))
    return pids


def test_greedy_outputs_equal_one_engine_and_cache_aware_routing(server, model):
    assert len(_core_pids(server.proc.pid)) == 2
    prompts = [f"{SHARED} {q}" for q in QUESTIONS]
    llm = LLM(model, device="cpu", dtype="float32", num_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(prompts, params)]
    assert all(expected)
    assert _complete(server.url, prompts) == expected

    # All four on one replica, whose prefix cache hits the shared 64 tokens for the last
    # three; the other replica saw none of them. (Round-robin would put two on each, and
    # each replica would miss the prefix once.)
    samples = scrape(server.url)
    done = _per_engine(samples, "vllm:request_success_total", finished_reason="length")
    hits = _per_engine(samples, "vllm:prefix_cache_hits_total")
    assert sorted(hits.values()) == [0.0, 3 * 64.0], hits
    busy = max(hits, key=hits.get)
    assert done[busy] == 4 and sum(done.values()) == 4, done

    # A prompt sharing nothing goes to the least-loaded replica: with both idle, the lower
    # index; then a burst of prompts with nothing shared spreads over both.
    import openai
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=60)

    async def burst():
        import asyncio
        prompts = [" ".join(f"w{(31 * k + i) % 250 + 3}" for i in range(3)) for k in range(8)]
        await asyncio.gather(*(client.completions.create(
            model="tiny", prompt=p, max_tokens=64, temperature=0.0,
            extra_body={"ignore_eos": True}) for p in prompts))

    import asyncio
    asyncio.run(burst())
    done = _per_engine(scrape(server.url), "vllm:request_success_total", finished_reason="length")
    assert sum(done.values()) == 12 and min(done.values()) >= 2, done


def test_a_killed_replica_makes_the_server_unhealthy_and_stop_leaves_no_core(server):
    cores = _core_pids(server.proc.pid)
    assert len(cores) == 2
    os.kill(cores[1], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        health = httpx.get(server.url + "/health", timeout=5)
        if health.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert health.status_code == 503
    assert "data-parallel replica" in health.json()["error"]["message"]
    refused = httpx.post(server.url + "/v1/completions", timeout=10,
                         json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2})
    assert refused.status_code == 503
    server.stop()
    assert all(pid_gone(pid, timeout=120) for pid in cores)
