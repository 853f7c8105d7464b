"""`rooflm simulate --calibrate`: time real engine steps once per GPU and model shape.

The engine (LLMEngine, the model and options given) serves a grid of offline batches:
for each context length L and batch size B, B fresh requests of L prompt tokens and a few
output tokens each. Each batch first prefills (chunks of up to max_num_batched_tokens,
beside the decodes of the requests already through: mixed steps), then decodes at B
sequences of context L..L+M; the grid spans batch sizes 1..max_num_seqs, contexts 128 to
3072, and prefill chunks from a few tokens to the full budget. Every step is recorded
through the engine's observer face (StepReport: the batch's shape, its wall time and the
host's share), the correction is fitted (calibration.fit_correction), and the table is
written as JSON with its samples.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Optional, TextIO

from rooflm.sim.calibration import CalibrationTable, StepSample, fit_correction
from rooflm.sim.cost_model import RooflineCostModel

# (context length, batch sizes): at most ~250k prompt tokens per context, so that the whole
# grid runs in well under a minute on an H100 with an 8B model.
DEFAULT_GRID = ((128, (1, 4, 16, 32, 64, 128, 256, 384, 512)),
                (1024, (1, 4, 16, 32, 64, 128)),
                (3072, (1, 4, 16, 32)))
OUTPUT_TOKENS = 24
# A step more than this many times slower than the fit predicts is an outlier (a kernel
# compiled mid-run, a host hiccup) and is left out of the refit.
OUTLIER_RATIO = 2.0


def _dtype_name(nbytes: float) -> str:
    return {4: "fp32", 2: "bf16", 1: "fp8"}.get(int(nbytes), "bf16")


def _run_batch(engine, batch: int, context: int, output_tokens: int, rng: random.Random, tag: str) -> None:
    from rooflm.sampling_params import SamplingParams

    vocab = engine.info.model_config.vocab_size
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True, output_kind="final")
    for i in range(batch):
        ids = [rng.randrange(min(100, vocab - 1), vocab) for _ in range(context)]
        engine.add_request(f"{tag}-{i}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()


def calibrate(engine_kwargs: dict, gpu_key: Optional[str] = None, grid=DEFAULT_GRID,
              output_tokens: int = OUTPUT_TOKENS, seed: int = 0, out: TextIO = None) -> CalibrationTable:
    from rooflm.perf.results import stamp
    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.perf.gpus import _match_table_entry, get_gpu

    out = out or sys.stdout
    engine = LLMEngine.from_kwargs(**engine_kwargs)
    info = engine.info
    if gpu_key is None:
        if info.device_type != "cuda":
            raise ValueError("--calibrate on the CPU needs --gpu NAME: the GPU whose roofline "
                             "the correction is relative to")
        import torch

        match = _match_table_entry(torch.cuda.get_device_name())
        if match is None:
            raise ValueError(f"{torch.cuda.get_device_name()} is not in the GPU table; pass --gpu NAME")
        gpu_key = match.key
    gpu = get_gpu(gpu_key)
    samples: list[StepSample] = []
    recording = [False]

    def observe(report) -> None:
        if recording[0]:
            t = report.timings
            samples.append(StepSample(report.shape, report.num_seqs, t.elapsed_s,
                                      t.schedule_s + t.launch_s + t.process_s))

    engine.add_observer(observe)
    rng = random.Random(seed)
    _run_batch(engine, 8, 128, 8, rng, "warmup")  # first-use costs out of the samples
    recording[0] = True
    t0 = time.perf_counter()
    for context, batches in grid:
        for batch in batches:
            if batch > info.max_num_seqs or context + output_tokens > info.max_model_len:
                continue
            before = len(samples)
            _run_batch(engine, batch, context, output_tokens, rng, f"c{context}-b{batch}")
            out.write(f"calibrate: context {context:>5}, batch {batch:>4}: {len(samples) - before:>4} steps\n")
            out.flush()
    wall = time.perf_counter() - t0
    weight_dtype, kv_dtype = _dtype_name(info.weight_dtype_bytes), _dtype_name(info.kv_dtype_bytes)
    model = RooflineCostModel(info.model_config, gpu, 1, weight_dtype, kv_dtype,
                              async_scheduling=info.async_scheduling)
    source = f"calibrated on {gpu.key}"
    correction, fit = fit_correction(samples, model, source)
    fitted = RooflineCostModel(info.model_config, gpu, 1, weight_dtype, kv_dtype, correction, info.async_scheduling)
    kept = [s for s in samples if s.elapsed_s < OUTLIER_RATIO * fitted.step_seconds(s.shape, s.num_seqs)]
    if len(kept) < len(samples):
        correction, fit = fit_correction(kept, model, source)
        fit["outliers_dropped"] = len(samples) - len(kept)
    fit["grid_wall_s"] = wall
    return CalibrationTable(
        gpu=gpu.key, device_name=_device_name(info.device), model_name=info.model, model=info.model_config,
        weight_dtype=weight_dtype, kv_dtype=kv_dtype, async_scheduling=info.async_scheduling,
        num_blocks=info.num_blocks, block_size=info.block_size, max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens, correction=correction, fit=fit,
        stamp=stamp(), samples=kept)


def _device_name(device: str) -> str:
    import torch

    from rooflm.perf.results import device_name

    return device_name(torch.device(device))
