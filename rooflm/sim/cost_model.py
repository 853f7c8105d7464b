"""How long one engine step takes: the roofline's floors, corrected by a calibration.

The roofline (perf/roofline.step_cost) gives every operation of a step its FLOPs and bytes;
on a GPU (perf/gpus) each operation's floor is the larger of FLOPs / peak and bytes /
bandwidth. Real kernels miss those floors by amounts that differ by kind of work, so the
floors are summed into six features (plus two fixed costs), and the device time of a step is

    device = c_decode [no prefill] + c_prefill [prefill] + a_lm lin_mem + a_lc lin_comp
             + a_am attn_mem + a_ac attn_comp + a_v vector + a_g gemv_mem + all-reduce time

  lin_mem / lin_comp    floors of the linear layers (weights, LM head) that are memory- /
                        compute-bound in this batch;
  gemv_mem              the same weight read as lin_mem, for a step of one token: the engine
                        runs those layers as fused GEMVs (model/llama.py, decode_gemv), which
                        read the weights nearer the bandwidth than the GEMMs of M >= 2 do
                        (measured on the H100: 1.1x its floor against 1.3x; a step of one
                        token has no lin_mem and a larger one no gemv_mem);
  attn_mem / attn_comp  the same for attention, per launch: the decode rows (one kernel,
                        reading K/V: memory-bound) and the prefill chunks (another, compute-
                        bound when long) are classified apart, as the engine launches them;
  vector                norms, rotary, activations, sampling;
  c_decode, c_prefill   fixed cost per step (launches, graph replay or piecewise graphs).

The host's work per step (scheduling, building inputs, processing outputs) is

    host = h_step + h_seq num_seqs + h_token prefill_tokens

With async scheduling the host prepares step t+1 while the device runs step t, so a step
takes max(device, host); without it, device + host. The coefficients come from a
calibration table (calibration.py) measured on a real engine; without one they are the
roofline itself (all a = 1, no fixed or host cost), which says how far a perfect engine
would go, and the output says so.

Tensor parallelism: step_cost(tp=N) gives one rank's share of the work and the bytes each
GPU sends; an all-reduce costs its bytes over the link bandwidth (x LINK_EFFICIENCY) plus
a fixed latency per collective (2 per layer, one for the embedding, one logits gather).

Pipeline parallelism (pp=N, distributed/pipeline.py): the engine runs a step through the
stages one after another, so a step's device time is the whole model's (each TP group's share,
as above) plus the activations sent between stages: [2, tokens, hidden] (hidden states and
residual) over each of the N - 1 boundaries, and the scored rows' [rows, hidden] back to stage 0,
each at the link's rate plus one collective's latency. One step at a time, each GPU idles
(N - 1) / N of it (the bubble, which describe() prints); with batches in flight the simulated
replica (sim/replica.py) starts the next batch after 1 / N of a step, which fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rooflm.config import ModelConfig
from rooflm.engine.report import BatchShape
from rooflm.perf.gpus import GpuSpec
from rooflm.perf.roofline import ATTENTION, COMM, KV_CACHE_BYTES, MATMUL, WEIGHT_FORMATS, step_cost

DEVICE_FEATURES = ("decode_step", "prefill_step", "lin_mem", "lin_comp", "attn_mem", "attn_comp", "vector",
                   "gemv_mem")
# The form of the features: 1 had no gemv_mem and priced a step's attention as one operation;
# 2 has gemv_mem and classifies the decode and prefill launches of attention apart. A table
# fitted under another form is refitted from its samples when loaded (calibration.py).
DEVICE_FORM = 2
HOST_FEATURES = ("step", "seq", "prefill_token")
ROOFLINE_DEVICE = (0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # the uncorrected floor
NO_HOST = (0.0, 0.0, 0.0)

# Assumptions for the all-reduce of tensor parallelism, not measured here (one GPU): NCCL's
# ring all-reduce reaches about 80% of the NVLink bandwidth per direction on large
# messages, and a collective of the small messages of decode costs ~10 us of latency.
LINK_EFFICIENCY = 0.8
ALLREDUCE_LATENCY_S = 10e-6

_SHAPE_KEYS = ("num_decode_seqs", "decode_context_tokens", "prefill_tokens",
               "prefill_attention_pairs", "prefill_context_tokens", "num_sampled_prefills")


class StepCostModel(Protocol):
    """Seconds of one engine step of this batch (num_seqs: sequences scheduled in it)."""

    def step_seconds(self, shape: BatchShape, num_seqs: int) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class SyntheticCostModel:
    """A step time from plain coefficients: for tests, toy plans and what-ifs."""

    step_s: float = 0.01
    per_token_s: float = 0.0  # per token through the layers
    per_seq_s: float = 0.0
    per_context_token_s: float = 0.0  # per K/V token read by decodes

    def step_seconds(self, shape: BatchShape, num_seqs: int) -> float:
        return (self.step_s + self.per_token_s * shape.num_tokens + self.per_seq_s * num_seqs
                + self.per_context_token_s * shape.decode_context_tokens)

    def describe(self) -> str:
        return (f"synthetic: {self.step_s * 1e3:g} ms/step + {self.per_token_s * 1e6:g} us/token + "
                f"{self.per_seq_s * 1e6:g} us/seq + {self.per_context_token_s * 1e9:g} ns/context token")


@dataclass(frozen=True)
class Correction:
    """Calibrated coefficients (DEVICE_FEATURES and HOST_FEATURES order) and where they are from."""

    device: tuple[float, ...] = ROOFLINE_DEVICE
    host: tuple[float, ...] = NO_HOST
    source: str = "datasheet roofline, no calibration"

    def __post_init__(self) -> None:
        if len(self.device) != len(DEVICE_FEATURES) or len(self.host) != len(HOST_FEATURES):
            raise ValueError(f"a correction has {len(DEVICE_FEATURES)} device and "
                             f"{len(HOST_FEATURES)} host coefficients")


class _AffineOps:
    """step_cost's per-operation FLOPs and bytes as affine functions of the batch's six
    integers (plus the LM head's weight read, present when a row is sampled), fixed by a few
    calls at construction and checked against step_cost on probe batches: evaluating them is
    ~30x cheaper than rebuilding the op list every simulated step."""

    def __init__(self, cost_fn, check: bool = True):
        zero = dict.fromkeys(_SHAPE_KEYS, 0)
        base = cost_fn(**zero).ops
        self.kinds = [op.kind for op in base]
        self.names = [op.name for op in base]
        self.base = [(op.flops, op.bytes) for op in base]
        self.coef = []
        for key in _SHAPE_KEYS:
            one, two = cost_fn(**{**zero, key: 1}).ops, cost_fn(**{**zero, key: 2}).ops
            self.coef.append([(b.flops - a.flops, b.bytes - a.bytes) for a, b in zip(one, two)])
        one = cost_fn(**{**zero, "num_sampled_prefills": 1}).ops
        nsp = self.coef[_SHAPE_KEYS.index("num_sampled_prefills")]
        self.sampled = [(o.flops - b[0] - c[0], o.bytes - b[1] - c[1])
                        for o, b, c in zip(one, self.base, nsp)]
        if check:  # _ExactOps is not affine and does not claim to be
            for probe in (dict(num_decode_seqs=3, decode_context_tokens=1000, prefill_tokens=77,
                               prefill_attention_pairs=5000, prefill_context_tokens=300, num_sampled_prefills=2),
                          dict(zero, num_decode_seqs=256, decode_context_tokens=256 * 4096),
                          dict(zero, prefill_tokens=2048, prefill_attention_pairs=2048 * 1024,
                               prefill_context_tokens=2048)):
                want = [(op.flops, op.bytes) for op in cost_fn(**probe).ops]
                got = self(tuple(probe[k] for k in _SHAPE_KEYS))
                for (gf, gb), (wf, wb) in zip(got, want):
                    if abs(gf - wf) > 1e-6 * max(wf, 1.0) or abs(gb - wb) > 1e-6 * max(wb, 1.0):
                        raise AssertionError("step_cost is no longer affine in the batch; the "
                                             "simulator's fast path needs updating")

    def __call__(self, x: tuple[int, ...]) -> list[tuple[float, float]]:
        ops = [list(b) for b in self.base]
        for value, coefs in zip(x, self.coef):
            if value:
                for op, (cf, cb) in zip(ops, coefs):
                    op[0] += cf * value
                    op[1] += cb * value
        if x[0] or x[5]:  # a sampled row: the LM head reads its weight
            for op, (sf, sb) in zip(ops, self.sampled):
                op[0] += sf
                op[1] += sb
        return [(f, b) for f, b in ops]


class _ExactOps(_AffineOps):
    """step_cost itself every step: an MoE model's expert reads follow the distinct experts a
    batch touches (perf/roofline.py expected_active_experts), which is not affine in the batch.
    The affine coefficients stay for what reads them (attention's, which is affine)."""

    def __init__(self, cost_fn):
        super().__init__(cost_fn, check=False)
        self.cost_fn = cost_fn

    def __call__(self, x: tuple[int, ...]) -> list[tuple[float, float]]:
        return [(op.flops, op.bytes) for op in self.cost_fn(**dict(zip(_SHAPE_KEYS, x))).ops]


def _shape_tuple(shape: BatchShape) -> tuple[int, ...]:
    return (shape.num_decode_seqs, shape.decode_context_tokens, shape.prefill_tokens,
            shape.prefill_attention_pairs, shape.prefill_context_tokens, shape.num_sampled_prefills)


@dataclass
class RooflineCostModel:
    """Step time of `model` on `gpu` (one TP group of `tp` GPUs), corrected by `correction`."""

    model: ModelConfig
    gpu: GpuSpec
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    correction: Correction = field(default_factory=Correction)
    async_scheduling: bool = True
    link_efficiency: float = LINK_EFFICIENCY
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S
    pp: int = 1  # pipeline stages, each a TP group of tp GPUs

    def __post_init__(self) -> None:
        fmt = WEIGHT_FORMATS[self.weight_dtype]
        act = 4.0 if self.weight_dtype == "fp32" else 2.0
        self._compute_dtype = fmt.compute_dtype
        ops = _ExactOps if self.model.num_experts else _AffineOps
        self._ops = ops(lambda **s: step_cost(
            self.model, **s, weight_bytes=fmt.bytes_per_param, kv_bytes=KV_CACHE_BYTES[self.kv_dtype],
            act_bytes=act, tp=self.tp, compute_dtype=fmt.compute_dtype))
        if self.tp * self.pp > 1 and self.gpu.interconnect_gbs is None:
            raise ValueError(f"{self.gpu.name} has no GPU-to-GPU link in the table; tp and pp must be 1")
        self._act_bytes = act
        peaks = {MATMUL: self.gpu.peak_flops(fmt.compute_dtype), ATTENTION: self.gpu.peak_flops("bf16")}
        vector_peak = self.gpu.peak_flops("fp32")
        self._peak = [peaks.get(k, vector_peak) for k in self._ops.kinds]
        attn = self._ops.kinds.index(ATTENTION)
        if self._ops.base[attn] != (0, 0):
            raise AssertionError("attention costs something in an empty batch; features() needs updating")
        self._attn_decode = (self._ops.coef[0][attn], self._ops.coef[1][attn])  # per decode row, per K/V token
        self._bw = self.gpu.mem_bw
        link = (self.gpu.interconnect_gbs or 0.0) * 1e9 * self.link_efficiency
        self._link = link
        self._collectives = 2 * self.model.num_hidden_layers + 2 if self.tp > 1 else 0

    def features(self, shape: BatchShape) -> tuple[list[float], float]:
        """The device features (DEVICE_FEATURES order) and the all-reduce seconds of a batch."""
        lin_mem = lin_comp = attn_mem = attn_comp = vector = comm = 0.0
        x = _shape_tuple(shape)
        for kind, peak, (flops, nbytes) in zip(self._ops.kinds, self._peak, self._ops(x)):
            if kind == COMM:
                comm = nbytes / self._link + self._collectives * self.allreduce_latency_s
                continue
            if kind == MATMUL:
                compute, memory = flops / peak, nbytes / self._bw
                if compute > memory:
                    lin_comp += compute
                else:
                    lin_mem += memory
            elif kind == ATTENTION:
                # Two launches: the decode rows' (affine in the first two integers) and the
                # prefill chunks' (the rest), each memory- or compute-bound on its own.
                (df, db), (dbf, dbb) = self._attn_decode
                dec_f, dec_b = df * x[0] + dbf * x[1], db * x[0] + dbb * x[1]
                for f, b in ((dec_f, dec_b), (flops - dec_f, nbytes - dec_b)):
                    compute, memory = f / peak, b / self._bw
                    if compute > memory:
                        attn_comp += compute
                    else:
                        attn_mem += memory
            else:
                vector += max(flops / peak, nbytes / self._bw)
        comm += self.pipeline_seconds(shape)
        prefill = 1.0 if shape.prefill_tokens else 0.0
        gemv_mem = 0.0
        if x[0] + x[2] == 1:  # one token: the fused GEMV path reads the weights
            gemv_mem, lin_mem = lin_mem, 0.0
        return [1.0 - prefill, prefill, lin_mem, lin_comp, attn_mem, attn_comp, vector, gemv_mem], comm

    def pipeline_seconds(self, shape: BatchShape) -> float:
        """The point-to-point transfers of a step between pipeline stages (0 without PP)."""
        if self.pp == 1:
            return 0.0
        hidden_bytes = self.model.hidden_size * self._act_bytes
        rows = shape.num_decode_seqs + shape.num_sampled_prefills
        nbytes = (self.pp - 1) * 2 * shape.num_tokens * hidden_bytes + rows * hidden_bytes
        return nbytes / self._link + self.pp * self.allreduce_latency_s

    @property
    def bubble(self) -> float:
        """The share of a step each GPU idles, waiting for the other stages (0 without PP)."""
        return (self.pp - 1) / self.pp

    def device_seconds(self, shape: BatchShape) -> float:
        feats, comm = self.features(shape)
        return sum(c * f for c, f in zip(self.correction.device, feats)) + comm

    def host_seconds(self, shape: BatchShape, num_seqs: int) -> float:
        h = self.correction.host
        return h[0] + h[1] * num_seqs + h[2] * shape.prefill_tokens

    def step_seconds(self, shape: BatchShape, num_seqs: int) -> float:
        device = self.device_seconds(shape)
        host = self.host_seconds(shape, num_seqs)
        return max(device, host) if self.async_scheduling else device + host

    def floor_seconds(self, shape: BatchShape) -> float:
        """The uncorrected roofline floor of the batch (all-reduces included)."""
        feats, comm = self.features(shape)
        return sum(feats[2:]) + comm

    def describe(self) -> str:
        tp = f", TP {self.tp} (all-reduce at {self.link_efficiency:.0%} of {self.gpu.interconnect_gbs:g} "\
             f"GB/s + {self.allreduce_latency_s * 1e6:g} us per collective)" if self.tp > 1 else ""
        pp = (f", PP {self.pp} (a step's stages in turn, each GPU idle {self.bubble:.0%} of it unless batches "
              f"are in flight; activations at {self.link_efficiency:.0%} of the link)") if self.pp > 1 else ""
        return f"{self.gpu.name} roofline ({self.gpu.source}){tp}{pp}; correction: {self.correction.source}"
