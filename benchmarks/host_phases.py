"""The engine's host time per decode step by phase, at a large batch, with a tiny random model.

Usage: python benchmarks/host_phases.py --model DIR [--batch 256] [--ctx 128] [--steps 10] [--reps 3]
           [--temperature 1.0] [--cprofile]

`rooflm profile` reports the same phases, but on a CPU its forward and sampler at batch 256 take
most of a second a step and its prefill of 256 long prompts minutes. Here the model is tiny (2
layers, hidden 64: make one with --make-model DIR, which writes a config.json beside the shipped
SmolLM2 tokenizer so that detokenization is real), so the host's own work - schedule, prepare
inputs, sampling metadata, detokenize + output - is measured at the batch and context (block
table width) of a real run: --ctx 1500 gives the ~100-entry block tables of Llama-3-8B at ctx 1500.

Phases are the profiler's (rooflm/perf/profile.py: EngineInstrument, exclusive CPU time), timed
over --steps decode steps, --reps times; the median of the reps is printed last. --cprofile
instead runs the timed steps under cProfile and prints the functions with the most own time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The phases the host owns; the forward, lm head and sample are the device's in a GPU run.
HOST_PHASES = ("schedule", "block_ops", "prepare", "to_device", "launch", "collect", "process", "step")


def make_model(out_dir: str) -> None:
    """A 2-layer, hidden-64 Llama config beside the SmolLM2 tokenizer."""
    from rooflm.tokenizer.dummy_model_dir import make_dummy_model_dir

    make_dummy_model_dir("smollm2-135m", out_dir, "default", max_position_embeddings=8192)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    # vocab 8192, not the tokenizer's 49152: on a CPU, freeing a step's [256, 49152] fp32 logits
    # (50 MB, returned to the OS by munmap) costs ~3 ms, billed to "launch, rest"; a GPU's caching
    # allocator pays nothing. Ids under 8192 are still real tokens, so detokenization is real.
    config.update(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, torch_dtype="float32")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/rooflm-host-tiny")
    parser.add_argument("--make-model", action="store_true", help="write the tiny model dir first")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ctx", type=int, default=128, help="prompt length (block table width)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--output-kind", default="delta", choices=("delta", "final"),
                        help="final: as offline runs (LLM.generate, bench throughput) submit")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()

    if args.make_model or not os.path.exists(os.path.join(args.model, "config.json")):
        make_model(args.model)

    import torch

    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.perf.profile import PHASES, EngineInstrument
    from rooflm.sampling_params import SamplingParams

    torch.set_num_threads(1)  # the forward is not measured; keep the second core for the host
    decode_steps = args.steps * (args.reps + 1) + 8
    max_len = args.ctx + decode_steps + 16
    blocks = args.batch * (-(-max_len // 16) + 1) + 64
    engine = LLMEngine.from_kwargs(model=args.model, load_format="dummy", device="cpu", dtype="float32",
                                   max_num_seqs=args.batch, num_blocks=blocks, block_size=16, max_model_len=max_len,
                                   max_num_batched_tokens=max(8192, args.ctx))
    vocab = engine.info.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=decode_steps, ignore_eos=True, seed=None,
                            output_kind=args.output_kind)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(100, vocab) for _ in range(args.ctx)], params)
    # Prefill until every sequence decodes, then a few decode steps more.
    while engine.snapshot().num_waiting_reqs or any(
            r.seqs[0].num_computed_tokens < r.seqs[0].num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(4):
        engine.step()

    instrument = EngineInstrument(engine, None, use_nvtx=False)
    instrument.install()
    labels = dict(PHASES)
    if args.cprofile:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        instrument.run_pass(args.steps)
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats("rooflm", 60)
        return
    runs = []
    for rep in range(args.reps):
        record = instrument.run_pass(args.steps)
        n = len(record.step_wall_s)
        runs.append({name: 1e3 * record.phase_s.get(name, 0.0) / n for name in HOST_PHASES})
        print(f"rep {rep}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1].items())
              + f", host total {sum(runs[-1].values()):.3f} ms")
    print(f"\nbatch {args.batch}, ctx {args.ctx}, temperature {args.temperature}, output_kind {args.output_kind}: "
          f"host ms per decode step "
          f"over {args.reps} reps x {args.steps} steps: median, min")
    for name in HOST_PHASES:
        values = [r[name] for r in runs]
        print(f"  {labels[name]:<45} {statistics.median(values):8.3f} {min(values):8.3f}")
    totals = [sum(r.values()) for r in runs]
    print(f"  {'host total':<45} {statistics.median(totals):8.3f} {min(totals):8.3f}")


if __name__ == "__main__":
    main()
