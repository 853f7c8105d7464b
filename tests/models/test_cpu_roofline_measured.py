"""The CPU roofline's bound for the default model is within 2x of a measured decode step (issue 52:
"the bound is a real number near what `bench latency` measures").

Wall-clock times on a shared 2-core machine swing 2-4x with the neighbours' load (an OpenMP step
waits on its slowest thread, a neighbour takes the core away mid-step), so both sides are taken
where load cannot reach them:
  - one thread: the decoder's OpenMP region never waits on a second, descheduled thread;
  - the step in CPU seconds (time.process_time): time the scheduler gave a neighbour is not in it;
  - the best of ~70 decode steps (three requests of 24): a step a neighbour's cache
    traffic slowed is not the best one;
  - the roofs as the roofline measures them (perf/gpus.py: best of 5 runs, this thread count).
Load can still slow what remains (shared L3 and DRAM), which pushes the measurement up, away
from the bound: on the shared Xeon at load 5-10 the best step was 0.9-1.5x the bound
(docs/performance.md).
The check goes both ways: a bound far under the step is the bug issue 52 reported (the native
int8 block dot priced at the fp32 FMA rate, 4x under), a bound far over it is a floor that is not
one. The same floor at 2 threads against `bench latency`'s wall clock: benchmarks/cpu_roofline_check.py."""

import io
import random
import time

import pytest
import torch

from rooflm.cli import build_parser
from rooflm.sampling_params import SamplingParams

# A short prompt: at one thread its prefill costs about a decode step a token.
PROMPT_TOKENS = 8
OUTPUT_TOKENS = 26
REQUESTS = 3


def roofline_step_floor_s(context: int) -> float:
    """`rooflm roofline --gpu cpu` for the default model: its decode step floor, in seconds."""
    args = build_parser().parse_args(["roofline", "--gpu", "cpu", "--context", str(context)])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    text = out.getvalue()
    return float(text.split("step floor ")[1].split(" ms")[0]) / 1e3


def best_decode_step_cpu_s(engine) -> float:
    """The fewest CPU seconds one batch-1 decode step took, over REQUESTS requests one at a time."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    decode = []
    for i in range(REQUESTS):
        prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"roofline-check-{i}", prompt, params)
        steps = []
        while engine.has_unfinished_requests():
            start = time.process_time()
            engine.step()
            steps.append(time.process_time() - start)
        # The first step is the prefill, the last may only hand back the final token.
        decode += steps[1:-1]
    assert len(decode) >= REQUESTS * (OUTPUT_TOKENS - 3)
    return min(decode)


@pytest.mark.exclusive
def test_cpu_roofline_bound_is_within_2x_of_a_measured_decode_step(smollm2, monkeypatch):
    from rooflm.perf import gpus

    monkeypatch.setattr(gpus, "_cache", {})  # measured here, at this test's thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = best_decode_step_cpu_s(smollm2.engine)
        bound = roofline_step_floor_s(PROMPT_TOKENS + OUTPUT_TOKENS // 2)
    finally:
        torch.set_num_threads(threads)
    ratio = measured / bound
    assert 0.5 <= ratio <= 2.0, (f"best decode step {measured * 1e3:.2f} ms (CPU time, 1 thread) is "
                                 f"{ratio:.2f}x the roofline's step floor {bound * 1e3:.2f} ms")


def test_the_cpu_engine_reports_its_int8_block_matmuls(smollm2):
    """`bench latency` and the live meter price the engine's steps from EngineInfo: on a CPU the
    default model's linears run in the native int8 block kernels, so at that roof."""
    assert smollm2.engine.info.matmul_dtype == "int8"
