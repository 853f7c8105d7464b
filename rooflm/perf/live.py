"""Live utilisation: each engine step's achieved bandwidth and FLOP rate against the roofline.

The engine reports every step (engine/report.py: StepReport, with the batch's
BatchShape and its wall time); this module turns the shape into the bytes the
step had to move and the FLOPs it had to do (the analytic model of
`rooflm.perf.roofline.step_cost`), and divides by the measured time:

    MBU = step bytes / elapsed / peak bandwidth
    MFU = step FLOPs / elapsed / peak FLOP/s of the linear layers' format

One meter is the one step-cost model: the server's Prometheus gauges, its log
line, `rooflm bench throughput --breakdown` and `rooflm profile` all attach a
StepMeter to the engine as an observer (engine.add_observer(meter.observe)).

It runs every step, so it stays cheap: step_cost's totals are evaluated from
coefficients fixed at construction (_AffineStepCost) rather than its op list
rebuilt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from rooflm.config import ModelConfig
from rooflm.engine.report import BatchShape, EngineInfo, StepReport
from rooflm.perf.gpus import GpuSpec, _match_table_entry
from rooflm.perf.roofline import step_cost


@dataclass
class StepStats:
    """One step: what it had to move and compute, and how fast that was."""

    elapsed_s: float
    bytes: float  # device-memory bytes the step had to move (step_cost)
    flops: float
    achieved_gbps: float  # bytes / elapsed, in GB/s (1e9)
    achieved_tflops: float  # flops / elapsed, in TFLOP/s (1e12)
    mbu: Optional[float]  # None without a GPU spec
    mfu: Optional[float]
    num_tokens: int = 0  # tokens through the layers (decode rows + prefill tokens)
    num_sampled: int = 0  # rows through the LM head and the sampler


@dataclass
class MeterSummary:
    """The rolling window: sums over its steps, rates over their summed step time.

    Rates are over the time spent inside steps, not wall time: an idle engine
    does not drag MBU down, and the log line says how busy it was instead.
    """

    steps: int
    busy_s: float
    tokens_per_s: float  # all tokens through the layers (prompt + decode)
    sampled_per_s: float  # generated tokens
    achieved_gbps: float
    achieved_tflops: float
    mbu: Optional[float]
    mfu: Optional[float]

    def format(self) -> str:
        """A short fragment for the engine's periodic log line."""
        if self.steps == 0:
            return "no steps"
        text = (f"{self.tokens_per_s:,.0f} tok/s ({self.sampled_per_s:,.0f} generated), "
                f"{self.achieved_gbps:,.1f} GB/s, {self.achieved_tflops:,.2f} TFLOP/s")
        if self.mbu is not None:
            text += f", MBU {self.mbu:.1%}"
        if self.mfu is not None:
            text += f", MFU {self.mfu:.1%}"
        return text


def _compute_dtype_for(weight_dtype_bytes: float) -> str:
    return "fp32" if weight_dtype_bytes >= 4 else "bf16"


_SHAPE_KEYS = ("num_decode_seqs", "decode_context_tokens", "prefill_tokens",
               "prefill_attention_pairs", "prefill_context_tokens", "num_sampled_prefills")


class _AffineStepCost:
    """step_cost's bytes and FLOPs for one model and dtypes, without building its op list.

    step_cost adds up products of the batch's six integers with constants of the
    model and the dtypes, except for one step: the LM head's weight is read only
    when some row is sampled. So bytes and FLOPs are base + coef . batch, plus
    the head's read when num_decode_seqs + num_sampled_prefills > 0, and a few
    calls of step_cost at construction fix base, coef and the head's read. The
    meter checks this against step_cost on probe batches and does not use it if
    they disagree (a future non-linear term), calling step_cost every step instead.
    """

    def __init__(self, cost_fn):
        zero = dict.fromkeys(_SHAPE_KEYS, 0)

        def at(**shape):
            cost = cost_fn(**{**zero, **shape})
            return cost.bytes, cost.flops

        self.base = at()
        self.coef = {}
        for key in _SHAPE_KEYS:
            one, two = at(**{key: 1}), at(**{key: 2})
            self.coef[key] = (two[0] - one[0], two[1] - one[1])
        one = at(num_sampled_prefills=1)
        c = self.coef["num_sampled_prefills"]
        self.head = (one[0] - self.base[0] - c[0], one[1] - self.base[1] - c[1])
        self.ok = all(self._matches(cost_fn, probe) for probe in (
            dict(num_decode_seqs=3, decode_context_tokens=1000, prefill_tokens=77,
                 prefill_attention_pairs=5000, prefill_context_tokens=300, num_sampled_prefills=2),
            dict(zero, prefill_tokens=5, prefill_attention_pairs=15, prefill_context_tokens=5),
            dict(zero, num_decode_seqs=256, decode_context_tokens=256 * 4096)))

    def _matches(self, cost_fn, shape: dict) -> bool:
        cost = cost_fn(**shape)
        got = self(shape)
        return all(abs(g - r) <= 1e-9 * max(abs(r), 1.0) for g, r in zip(got, (cost.bytes, cost.flops)))

    def __call__(self, shape: dict) -> tuple[float, float]:
        b, f = self.base
        for key, value in shape.items():
            if value:
                cb, cf = self.coef[key]
                b += cb * value
                f += cf * value
        if shape["num_decode_seqs"] or shape["num_sampled_prefills"]:
            b += self.head[0]
            f += self.head[1]
        return b, f


class StepMeter:
    """Turns (SchedulerOutput, elapsed seconds) into StepStats and keeps a rolling window.

    model_config: the model's shape. weight_dtype_bytes / kv_dtype_bytes: bytes per
    weight parameter and per KV-cache element (4 for fp32, 2 for bf16, ...).
    gpu: the peaks to measure against, or None (CPU): then mbu and mfu are None.
    act_bytes: bytes per activation element (default: 4 with fp32 weights, else 2).
    compute_dtype: tensor-core format of the linear layers (default: fp32 with fp32
    weights, else bf16; pass "fp8" for W8A8). window: steps kept for summary().
    """

    def __init__(self, model_config: ModelConfig, weight_dtype_bytes: float, kv_dtype_bytes: float,
                 gpu: Optional[GpuSpec] = None, *, act_bytes: Optional[float] = None,
                 compute_dtype: Optional[str] = None, window: int = 256,
                 head_bytes: Optional[float] = None, tp: int = 1):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.model_config = model_config
        self.weight_bytes = float(weight_dtype_bytes)
        self.kv_bytes = float(kv_dtype_bytes)
        self.head_bytes = head_bytes  # None: step_cost's rule
        self.tp = tp  # tensor-parallel ranks: a step's cost is one rank's share plus its all-reduces
        self.act_bytes = float(act_bytes if act_bytes is not None
                               else (4.0 if weight_dtype_bytes >= 4 else 2.0))
        self.compute_dtype = compute_dtype or _compute_dtype_for(weight_dtype_bytes)
        self.gpu = gpu
        self._window = window
        # Peaks resolved once; a GPU lacking the format raises here, not every step.
        self._bw = gpu.mem_bw if gpu is not None else None
        self._peak = gpu.peak_flops(self.compute_dtype) if gpu is not None else None
        self._affine = _AffineStepCost(self._step_cost)
        self._recent: deque[StepStats] = deque(maxlen=window)
        self.total_steps = 0
        self.total_elapsed_s = 0.0
        self.total_tokens = 0
        self.total_sampled = 0

    @classmethod
    def for_engine(cls, info: EngineInfo, gpu: Optional[GpuSpec] = None, **kwargs) -> "StepMeter":
        """A meter for an engine, from its EngineInfo: model shape, dtypes, device's GPU.

        gpu: None looks the device up in the GPU table (default_gpu_for).
        """
        if gpu is None:
            gpu = default_gpu_for(info.device)
        act = info.act_dtype_bytes or info.weight_dtype_bytes
        kwargs.setdefault("act_bytes", act)
        # W8A8 (fp8) linears run on the fp8 tensor cores whatever the activations' dtype.
        kwargs.setdefault("compute_dtype", info.matmul_dtype or _compute_dtype_for(act))
        kwargs.setdefault("head_bytes", info.head_dtype_bytes or None)
        kwargs.setdefault("tp", info.tensor_parallel_size)
        return cls(info.model_config, info.weight_dtype_bytes, info.kv_dtype_bytes, gpu, **kwargs)

    # ---- one step -------------------------------------------------------------------------

    def observe(self, report: StepReport) -> StepStats:
        """An engine observer: account the reported step over its wall time."""
        return self.record(report.shape, report.timings.elapsed_s)

    def _step_cost(self, **shape):
        return step_cost(self.model_config, **shape, weight_bytes=self.weight_bytes,
                         kv_bytes=self.kv_bytes, act_bytes=self.act_bytes,
                         compute_dtype=self.compute_dtype, head_bytes=self.head_bytes, tp=self.tp)

    def cost(self, shape: BatchShape):
        """step_cost of the batch, every op of it."""
        return self._step_cost(**shape.as_kwargs())

    def record(self, batch: BatchShape, elapsed_s: float) -> StepStats:
        """Account one executed step of this shape that took `elapsed_s` seconds (with the
        device's work in it: the engine's report times a step to its results on the host)."""
        shape = batch.as_kwargs()
        if self._affine.ok:
            step_bytes, step_flops = self._affine(shape)
        else:
            cost = self._step_cost(**shape)
            step_bytes, step_flops = cost.bytes, cost.flops
        num_tokens = shape["num_decode_seqs"] + shape["prefill_tokens"]
        num_sampled = shape["num_decode_seqs"] + shape["num_sampled_prefills"]
        elapsed = elapsed_s if elapsed_s > 0 else 1e-12
        bw = step_bytes / elapsed
        rate = step_flops / elapsed
        stats = StepStats(
            elapsed_s=elapsed_s, bytes=step_bytes, flops=step_flops,
            achieved_gbps=bw / 1e9, achieved_tflops=rate / 1e12,
            mbu=bw / self._bw if self._bw else None,
            mfu=rate / self._peak if self._peak else None,
            num_tokens=num_tokens, num_sampled=num_sampled)
        self._recent.append(stats)
        self.total_steps += 1
        self.total_elapsed_s += elapsed_s
        self.total_tokens += num_tokens
        self.total_sampled += num_sampled
        return stats

    # ---- the window ----------------------------------------------------------------------

    def summary(self) -> MeterSummary:
        """Rates over the last `window` steps, for the engine's periodic log line."""
        steps = list(self._recent)
        busy = sum(s.elapsed_s for s in steps)
        if not steps or busy <= 0:
            return MeterSummary(len(steps), busy, 0.0, 0.0, 0.0, 0.0,
                                0.0 if self.gpu else None, 0.0 if self.gpu else None)
        total_bytes = sum(s.bytes for s in steps)
        total_flops = sum(s.flops for s in steps)
        bw = total_bytes / busy
        rate = total_flops / busy
        return MeterSummary(
            steps=len(steps), busy_s=busy,
            tokens_per_s=sum(s.num_tokens for s in steps) / busy,
            sampled_per_s=sum(s.num_sampled for s in steps) / busy,
            achieved_gbps=bw / 1e9, achieved_tflops=rate / 1e12,
            mbu=bw / self._bw if self._bw else None,
            mfu=rate / self._peak if self._peak else None)

    def reset(self) -> None:
        self._recent.clear()


def default_gpu_for(device) -> Optional[GpuSpec]:
    """The GPU table's entry for a CUDA device (H100 -> h100, H200 -> h200, A100 -> a100, ...).

    None for a CPU, or for a CUDA device the table does not know (measure it
    with rooflm.perf.gpus.measure_gpu instead).
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _match_table_entry(torch.cuda.get_device_name(device))
