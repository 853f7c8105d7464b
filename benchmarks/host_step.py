"""Host cost per sequence of a decode step, without a model: schedule, output processing (with a
real tokenizer's incremental detokenization) and the engine core's wire deltas.

Usage: python benchmarks/host_step.py [--seqs 512] [--steps 200] [--model DIR_WITH_TOKENIZER]

The engine core serves hundreds of streaming sequences on one Python thread; on an H100 its step
loop was the limit of `rooflm serve` at 512 sequences (benchmarks/results/serving-h100-20261123-s4).
This times the same host code on synthetic steps (every sequence decodes one token a step), so
changes to it can be measured on any machine. Prints microseconds per sequence per step by phase.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import msgspec

    from rooflm.config import SchedulerConfig
    from rooflm.engine.block_manager import BlockManager
    from rooflm.engine.core import EngineCore
    from rooflm.engine.core_protocol import StepOutputs
    from rooflm.engine.model_runner import StepResult
    from rooflm.engine.output_processor import OutputProcessor
    from rooflm.engine.request import Request
    from rooflm.engine.scheduler import Scheduler
    from rooflm.sampling_params import SamplingParams
    from rooflm.tokenizer.tokenizer import load_model_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=230)
    parser.add_argument("--model", default="benchmarks/models/llama-3-8b-dummy",
                        help="a directory with tokenizer files (make_dummy_model_dir.py makes one)")
    parser.add_argument("--no-tokenizer", action="store_true")
    parser.add_argument("--gc", default="engine",
                        help="engine (the engine's settings: rooflm/engine/host_gc.py) | default (Python's) "
                             "| off | freeze | freeze+T (T: gen0 threshold)")
    args = parser.parse_args()

    tokenizer = None if args.no_tokenizer else load_model_tokenizer(None, args.model, "dummy")
    vocab = 49152 if tokenizer is None else len(tokenizer.hf)
    bm = BlockManager(args.seqs * (args.prompt_len + args.steps + 32) // 16 + 64, 16, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=args.seqs, max_num_batched_tokens=1 << 20), bm)
    outputs = OutputProcessor(sched, tokenizer, {2}, 1 << 20, itertools.count())
    rng = random.Random(0)
    tracked = {}
    for i in range(args.seqs):
        ids = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 10, ignore_eos=True)
        req = Request(f"r{i}", None, ids, params, params.max_tokens)
        req.seqs.append(outputs.new_seq(req, 0, list(ids)))
        sched.add(req)
        tracked[req.request_id] = _Tracked()
    encoder = msgspec.msgpack.Encoder()
    _set_gc(args.gc)
    totals = {"schedule": 0.0, "process": 0.0, "deltas+encode": 0.0}
    timed_steps = 0
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        result = StepResult({s.seq.seq_id: [rng.randrange(100, vocab)] for s in out.scheduled if s.completes},
                            {}, {})
        t2 = time.perf_counter()
        request_outputs = outputs.process(out, result)
        t3 = time.perf_counter()
        deltas = [EngineCore._delta(o, tracked[o.request_id]) for o in request_outputs]
        encoder.encode(StepOutputs(deltas, [], None))
        t4 = time.perf_counter()
        if step == 0:
            continue  # the prefill step
        timed_steps += 1
        totals["schedule"] += t1 - t0
        totals["process"] += t3 - t2
        totals["deltas+encode"] += t4 - t3
    per = 1e6 / (timed_steps * args.seqs)
    print(f"{args.seqs} sequences, {timed_steps} decode steps, tokenizer: {tokenizer is not None}")
    for name, seconds in totals.items():
        print(f"  {name:<14} {seconds * per:7.2f} us per sequence per step")
    print(f"  {'total':<14} {sum(totals.values()) * per:7.2f} us per sequence per step "
          f"({sum(totals.values()) * 1e3 / timed_steps:.2f} ms per step)")


def _set_gc(mode: str) -> None:
    import gc

    if mode == "engine":
        from rooflm.engine.host_gc import tune_gc_for_serving
        tune_gc_for_serving()
    elif mode == "off":
        gc.disable()
    elif mode.startswith("freeze"):
        gc.freeze()
        if "+" in mode:
            gc.set_threshold(int(mode.split("+")[1]), 10, 10)


class _Tracked:
    """What EngineCore._delta reads of its own request record."""

    def __init__(self):
        from types import SimpleNamespace
        self.sent_first_output = True
        self.request = SimpleNamespace(params=SimpleNamespace(output_kind="delta"), scheduled_time=None,
                                       arrival_time=0.0)


if __name__ == "__main__":
    main()
