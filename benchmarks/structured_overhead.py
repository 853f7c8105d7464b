"""What structured outputs cost per decode step: TPOT with a JSON schema vs unconstrained.

B requests of --input-len random tokens decode together; once every request has its first
token, each engine step is timed until --output-len tokens. Variants, alternated --repeats
times in one process on one engine (same graphs, same KV pool):
  free    no constraint (ignore_eos, so every request runs to --output-len)
  schema  a JSON schema: {"summary": string of minLength --min-chars}, so every request stays
          inside the string value for the whole measurement (EOS is not allowed there) and
          the mask is filled and applied every step. This is the common case of JSON output,
          the body of a value; the grammar's structural tokens ({, "summary", :) come first.
TPOT is the median step time over the decode steps. The schema variant includes, per step,
the host's bitmask fill (xgrammar, batched over threads), its copy to the device and the
masking of the logits, and under async scheduling the split of the step (the forward is
queued before the previous step's tokens reach the matchers, the sampling after).

Needs a model with a tokenizer. On the GPU, the 8B shape with SmolLM2's tokenizer, made here
(`python benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out /tmp/l3-8b`) and carried:

    python benchmarks/structured_overhead.py --model /tmp/l3-8b --load-format dummy \\
        --batch-size 64 --input-len 128 --output-len 256 --out benchmarks/results/structured-h100
On the CPU (the default model, SmolLM2-135M):
    python benchmarks/structured_overhead.py --batch-size 8 --input-len 32 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm.perf.results import git_commit  # noqa: E402
from rooflm.engine_args import add_engine_args, engine_kwargs  # noqa: E402
from rooflm.engine.llm_engine import LLMEngine  # noqa: E402
from rooflm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402


def schema(min_chars: int) -> dict:
    return {"type": "object", "required": ["summary"], "additionalProperties": False,
            "properties": {"summary": {"type": "string", "minLength": min_chars,
                                       "maxLength": 4 * min_chars}}}


def _sync(engine: LLMEngine) -> None:
    if engine.info.device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def run_variant(engine: LLMEngine, variant: str, args, round_index: int) -> dict:
    vocab = engine.model_config.vocab_size
    rng = random.Random(round_index)
    constraint = None
    if variant == "schema":
        constraint = StructuredOutputsParams(json=schema(args.min_chars))
    params = SamplingParams(temperature=1.0, seed=round_index, max_tokens=args.output_len,
                            ignore_eos=variant == "free", structured_outputs=constraint)
    ids = []
    for i in range(args.batch_size):
        rid = f"{variant}-{round_index}-{i}"
        engine.add_request(rid, [rng.randrange(10, vocab) for _ in range(args.input_len)], params)
        ids.append(rid)
    tokens = {rid: 0 for rid in ids}
    step_ms, finish = [], {}
    while engine.has_unfinished_requests():
        all_started = all(n > 0 for n in tokens.values())
        _sync(engine)
        t0 = time.perf_counter()
        outs = engine.step()
        _sync(engine)
        elapsed = (time.perf_counter() - t0) * 1e3
        for out in outs:
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
        if all_started and all(n < args.output_len for n in tokens.values()):
            step_ms.append(elapsed)  # every request decoding, none finished
    if variant == "schema" and any(reason != "length" for reason in finish.values()):
        raise RuntimeError(f"a constrained request ended early ({finish}): raise --min-chars")
    return {"variant": variant, "round": round_index, "steps": len(step_ms),
            "tpot_ms_median": statistics.median(step_ms), "tpot_ms_mean": statistics.fmean(step_ms)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-chars", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="directory for result.json and result.md")
    add_engine_args(p)  # --model, --load-format, --dtype, --async-scheduling, ... as every command
    p.set_defaults(max_model_len=1024)
    args = p.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.batch_size, 1)

    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    if engine.tokenizer is None:
        raise SystemExit("the model has no tokenizer: make one with benchmarks/make_dummy_model_dir.py")
    # Warm-up: compile the grammar, and run both paths once (graphs, allocator, xgrammar caches).
    warm = argparse.Namespace(**{**vars(args), "batch_size": min(args.batch_size, 2), "output_len": 8})
    for variant in ("free", "schema"):
        run_variant(engine, variant, warm, 1000)
    rows = []
    for round_index in range(args.repeats):
        for variant in ("free", "schema"):
            rows.append(run_variant(engine, variant, args, round_index))
            print(json.dumps(rows[-1]), flush=True)
    tpot = {v: statistics.median(r["tpot_ms_median"] for r in rows if r["variant"] == v)
            for v in ("free", "schema")}
    ratio = tpot["schema"] / tpot["free"]
    commit = git_commit()  # ROOFLM_COMMIT where the tree is a copy (the device machine)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit,
              "device": engine.info.device, "model": args.model or "default",
              "async_scheduling": engine.info.async_scheduling, "batch_size": args.batch_size,
              "input_len": args.input_len, "output_len": args.output_len,
              "tpot_ms_free": tpot["free"], "tpot_ms_schema": tpot["schema"],
              "schema_over_free": ratio, "rounds": rows}
    if engine.info.device.startswith("cuda"):
        import torch
        result["gpu"] = torch.cuda.get_device_name()
    line = (f"batch {args.batch_size}: TPOT free {tpot['free']:.2f} ms, JSON schema "
            f"{tpot['schema']:.2f} ms, ratio {ratio:.3f} ({result['device']}, async "
            f"{engine.info.async_scheduling})")
    print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "result.md"), "w") as f:
            f.write(f"# Structured-output overhead ({result['date']}, commit {commit})\n\n{line}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
