"""Service levels through the real FastAPI stack, on a tiny random Llama with a word-level tokenizer:
sleep mode (in-process engine thread and the engine-core process over ZMQ), SLO-aware shedding
(the 503 comes before the engine sees the request), the request's priority field, and the
metrics an autoscaler reads. No test asserts a time: waits are on events, with generous bounds.
"""

import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from rooflm.llm import LLM
from rooflm.errors import InvalidRequest
from rooflm.sampling_params import SamplingParams
from rooflm.server.app import create_app
from rooflm.server.config import ServerConfig
from tests.models.tiny_models import make_tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8]
WAIT_S = 60  # the bound on every wait for an event


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny"))


def _engine_kwargs(model: str, **extra) -> dict:
    return dict(model=model, device="cpu", dtype="float32", num_blocks=32, max_model_len=256, **extra)


def _greedy(client: TestClient, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                                                "temperature": 0, "ignore_eos": True, **extra})


def _metric(client: TestClient, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not exported")


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


# ---- sleep mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-core"])
def test_sleep_and_wake_keep_greedy_outputs_and_refuse_work_while_asleep(model, engine_process):
    app = create_app(_engine_kwargs(model, enable_sleep_mode=True, scheduling_policy="priority"),
                     ServerConfig(served_model_name="tiny", log_interval=0),
                     engine_process=engine_process)
    with TestClient(app) as client:
        _wait_until(lambda: client.get("/ready").status_code == 200, "the warm-up")
        before = _greedy(client)
        assert before.status_code == 200, before.text
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        for level in (1, 2):
            assert client.post(f"/sleep?level={level}").status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            health = client.get("/health")
            assert health.status_code == 200 and health.json() == {"is_sleeping": True}
            assert client.get("/ready").status_code == 503
            refused = _greedy(client)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "sleeping" and "sleeping" in error["message"]
            assert int(refused.headers["Retry-After"]) >= 1
            _wait_until(lambda: _metric(client, "rooflm:is_sleeping") == 1, "the sleeping gauge")
            woke = client.post("/wake_up")
            assert woke.status_code == 200 and woke.json()["phases"]["level"] == level, woke.text
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            after = _greedy(client)
            assert after.status_code == 200, after.text
            assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"], level
        bad = client.post("/sleep?level=3")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
        # The priority policy takes the field; a type error names it.
        assert _greedy(client, priority=-5).status_code == 200
        wrong = _greedy(client, priority="high")
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "priority"


def test_sleep_aborts_what_runs_with_a_clear_reason(model):
    app = create_app(_engine_kwargs(model, enable_sleep_mode=True),
                     ServerConfig(served_model_name="tiny", log_interval=0))
    with TestClient(app) as client:
        _wait_until(lambda: client.get("/ready").status_code == 200, "the warm-up")
        with client.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True,
                "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it runs
            assert client.post("/sleep?level=1").status_code == 200
            rest = "\n".join(lines)
        # The stream ends with an error event naming why, as for any server-side abort.
        assert '"code":"aborted"' in rest and "the engine was put to sleep" in rest
        assert client.post("/wake_up").status_code == 200
        assert _greedy(client).status_code == 200


# ---- SLO-aware admission and the priority field under fcfs ------------------------------------


@pytest.fixture(scope="module")
def slo_app(model):
    # One sequence at a time: a long request runs (until the test closes its stream), the next
    # waits; nothing measures time.
    app = create_app(dict(_engine_kwargs(model, max_num_seqs=1), max_model_len=4096, num_blocks=300),
                     ServerConfig(served_model_name="tiny", log_interval=0))
    added: list[list[int]] = []
    engine = app.state.rooflm.engine
    real_add = engine.add_request

    def recording_add(request_id, prompt, *args, **kwargs):
        added.append(list(prompt))
        return real_add(request_id, prompt, *args, **kwargs)

    engine.add_request = recording_add
    app.state.added_prompts = added
    return app


def test_a_request_predicted_to_miss_its_budget_gets_503_before_any_prefill(slo_app):
    shed_prompt = [200, 201, 202, 203]
    with TestClient(slo_app) as client:
        _wait_until(lambda: client.get("/ready").status_code == 200, "the warm-up")
        waiting_done = threading.Event()

        def queued_request():
            _greedy(client)
            waiting_done.set()

        with client.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
                "stream": True}) as stream:
            lines = stream.iter_lines()  # kept: a closed iterator would close the stream
            assert next(line for line in lines if line.startswith("data:"))
            threading.Thread(target=queued_request, daemon=True).start()
            _wait_until(lambda: _metric(client, "vllm:num_requests_waiting") == 1, "a queue")
            _wait_until(lambda: _metric(client, "rooflm:predicted_queue_wait_seconds") > 0,
                        "the predicted wait")
            shed = client.post("/v1/completions", json={
                "model": "tiny", "prompt": shed_prompt, "max_tokens": 4, "deadline_ms": 0.001})
            assert shed.status_code == 503, shed.text
            assert shed.json()["error"]["code"] == "slo_shed"
            assert "time-to-first-token budget" in shed.json()["error"]["message"]
            assert int(shed.headers["Retry-After"]) >= 1
            assert _metric(client, "rooflm:shed_requests_total") == 1
            assert shed_prompt not in slo_app.state.added_prompts  # the engine never saw it
        assert waiting_done.wait(WAIT_S)  # the stream's end aborted the long request
        # A budget the queue can meet is admitted.
        assert _greedy(client, deadline_ms=600_000).status_code == 200
        assert _metric(client, "rooflm:shed_requests_total") == 1


def test_priority_field_under_fcfs_follows_vllm(slo_app):
    with TestClient(slo_app) as client:
        _wait_until(lambda: client.get("/ready").status_code == 200, "the warm-up")
        assert _greedy(client, priority=0).status_code == 200
        for value, words in ((3, "priority scheduling is not enabled"), (1.5, "priority"),
                             ("high", "priority")):
            response = _greedy(client, priority=value)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "priority" and words in error["message"], error
        bad = _greedy(client, deadline_ms=-1)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "deadline_ms"
        # Without --enable-sleep-mode the sleep endpoints say which flag they need.
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            response = client.request(method, path)
            assert response.status_code == 404 and "--enable-sleep-mode" in response.text


# ---- the offline API ------------------------------------------------------------------------------


def test_llm_generate_takes_one_priority_per_prompt(model):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm = LLM(model, device="cpu", dtype="float32", num_blocks=32, max_model_len=256,
              scheduling_policy="priority", enable_sleep_mode=True)
    outs = llm.generate([PROMPT, PROMPT[:4]], params, priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate([PROMPT], params, priority=[0, 1])
    llm.sleep(2)
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate([PROMPT], params)
    llm.wake_up()
    assert llm.generate([PROMPT, PROMPT[:4]], params)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    fcfs = LLM(model, device="cpu", dtype="float32", num_blocks=32, max_model_len=256)
    with pytest.raises(InvalidRequest, match="priority scheduling is not enabled"):
        fcfs.generate([PROMPT], params, priority=[2])
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        fcfs.sleep(1)


# ---- CUDA (the lead's GPU run) ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_device_and_wakes_to_equal_outputs_on_cuda(level):
    """The weights and the KV pool live on CUDA virtual-memory regions (engine/sleep_memory.py):
    sleep gives their physical memory back (level 1 keeps the weights in pinned host memory,
    level 2 drops them: wake_up draws the same seeded dummy weights again). Level 1 maps them
    back at the same addresses, so the CUDA graphs are kept, not captured again; level 2's new
    weights are captured again. Either way the greedy tokens equal those before."""
    import torch

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM("smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", num_blocks=256,
              max_model_len=512, enable_sleep_mode=True)
    runner = llm.engine.runner
    assert runner.weights_region is not None and runner.kv_region is not None, "no CUDA virtual memory"
    before = [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT[:3]], params)]
    graphs = runner.graphs
    assert graphs is not None and graphs.graphs
    given_back = runner.kv_region.nbytes + runner.weights_region.nbytes
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    llm.sleep(level)
    free_asleep, _ = torch.cuda.mem_get_info()
    # mem_get_info: the driver's count, which sees the regions (memory_allocated does not).
    assert free_asleep - free_awake >= 0.9 * given_back, (free_awake, free_asleep, given_back)
    if level == 1:
        assert runner._weights_host is not None and runner._weights_host.is_pinned()
    else:
        assert runner.model is None
    phases = llm.wake_up()
    assert phases["graphs"] == ("kept" if level == 1 else "captured"), phases
    assert (runner.graphs is graphs) == (level == 1)
    after = [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT[:3]], params)]
    assert after == before
