"""Calibration tables: measured step times of one GPU and model shape, and the correction
fitted to them (cost_model.Correction).

A table is a small JSON file written by `rooflm simulate --calibrate` (calibrate.py). It
keeps the raw samples, one per engine step (batch shape, sequences, wall time, the host's
share), so a later cost model can be refitted without a GPU, and the fitted coefficients:

  device  non-negative least squares of the step's wall time on the roofline features
          (cost_model.DEVICE_FEATURES), over the steps where the device, not the host,
          set the pace (host work under HOST_BOUND_SHARE of the step) and that sampled a
          token (see fit_correction), weighted by 1 / time so that every step counts by its
          relative error, with weak prior rows (fixed costs small, efficiencies near the
          roofline) for what the data cannot tell;
  host    non-negative least squares of the host's busy time per step (schedule + launch
          + process) on a constant, the sequences and the prefill tokens.

A GPU without a table is priced by its datasheet roofline with the device coefficients of
the closest measured GPU (nearest in memory bandwidth and bf16 peak, log scale) and that
table's host coefficients (the host is the same code on a like CPU); the cost model's
description names the table it borrowed from.

A table records the form of the features its coefficients were fitted to (DEVICE_FORM); one
of an older form is refitted from its samples as it is loaded (CalibrationTable._refit_old_form).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from rooflm.config import ModelConfig, RopeScaling
from rooflm.engine.report import BatchShape
from rooflm.perf.gpus import GpuSpec, get_gpu
from rooflm.sim.cost_model import DEVICE_FEATURES, DEVICE_FORM, HOST_FEATURES, Correction, RooflineCostModel

FORMAT = "rooflm-sim-calibration/1"
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations")
HOST_BOUND_SHARE = 0.8
PRIOR_WEIGHT = 0.003  # per sqrt(sample): ~0.1% error on exact synthetic steps (tests/unit/test_sim.py)
PRIOR_FIXED_S = 10e-3  # the scale a fixed cost per step is measured against


@dataclass(frozen=True)
class StepSample:
    """One measured engine step."""

    shape: BatchShape
    num_seqs: int
    elapsed_s: float  # the step's wall time (results to results under async scheduling)
    host_s: float  # schedule + launch + process


@dataclass
class CalibrationTable:
    gpu: str  # key in perf/gpus.GPUS
    device_name: str
    model_name: str
    model: ModelConfig
    weight_dtype: str
    kv_dtype: str
    async_scheduling: bool
    num_blocks: int  # the KV pool the engine had (for simulating this exact engine)
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    correction: Correction
    fit: dict = field(default_factory=dict)  # error of the fit on its own samples
    stamp: dict = field(default_factory=dict)
    samples: list[StepSample] = field(default_factory=list)

    # ---- JSON -------------------------------------------------------------------------------

    def to_json(self) -> dict:
        model = asdict(self.model)
        return {
            "format": FORMAT, "gpu": self.gpu, "device_name": self.device_name,
            "model_name": self.model_name, "model": model, "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype, "async_scheduling": self.async_scheduling,
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "device_form": DEVICE_FORM,
            "device_coefficients": dict(zip(DEVICE_FEATURES, self.correction.device)),
            "host_coefficients": dict(zip(HOST_FEATURES, self.correction.host)),
            "fit": self.fit, "stamp": self.stamp,
            "sample_fields": ["num_decode_seqs", "decode_context_tokens", "prefill_tokens",
                              "prefill_attention_pairs", "prefill_context_tokens",
                              "num_sampled_prefills", "num_seqs", "elapsed_s", "host_s"],
            "samples": [[*s.shape.as_kwargs().values(), s.num_seqs, round(s.elapsed_s, 7),
                         round(s.host_s, 7)] for s in self.samples],
        }

    @classmethod
    def from_json(cls, data: dict, where: str = "calibration table") -> "CalibrationTable":
        if data.get("format") != FORMAT:
            raise ValueError(f"{where}: not a {FORMAT} file (format {data.get('format')!r})")
        model = dict(data["model"])
        if model.get("rope_scaling"):
            model["rope_scaling"] = RopeScaling(**model["rope_scaling"])
        # JSON has no tuples: ModelConfig's tuple fields (eos_token_ids, layer_types) come back as lists.
        model.update({name: tuple(value) for name, value in model.items() if isinstance(value, list)})
        model["eos_token_ids"] = tuple(model.get("eos_token_ids") or ())
        samples = [StepSample(BatchShape(*row[:6]), row[6], row[7], row[8]) for row in data.get("samples", [])]
        source = (f"calibrated on {data['device_name']} ({data['model_name']}, "
                  f"{data.get('stamp', {}).get('date', 'undated')})")
        device = data["device_coefficients"]
        if data.get("device_form", 1) != DEVICE_FORM and "gemv_mem" not in device:
            # A form-1 table: the one-token steps' weight read was lin_mem (see _refit_old_form).
            device = {**device, "gemv_mem": device["lin_mem"]}
        table = cls(
            gpu=data["gpu"], device_name=data["device_name"], model_name=data["model_name"],
            model=ModelConfig(**model), weight_dtype=data["weight_dtype"], kv_dtype=data["kv_dtype"],
            async_scheduling=data["async_scheduling"], num_blocks=data["num_blocks"],
            block_size=data["block_size"], max_num_seqs=data["max_num_seqs"],
            max_num_batched_tokens=data["max_num_batched_tokens"],
            correction=Correction(tuple(device[k] for k in DEVICE_FEATURES),
                                  tuple(data["host_coefficients"][k] for k in HOST_FEATURES), source),
            fit=data.get("fit", {}), stamp=data.get("stamp", {}), samples=samples)
        if data.get("device_form", 1) != DEVICE_FORM:
            table._refit_old_form(data.get("device_form", 1))
        return table

    def _refit_old_form(self, form: int) -> None:
        """A table fitted under another form of the features (cost_model.DEVICE_FORM): its
        coefficients price other features than the cost model computes now. With its samples
        it is refitted as loaded (a fraction of a second; `rooflm simulate --calibrate` or
        saving the table again makes it current); without them its coefficients are kept by
        name, a new feature taking the coefficient of the one it was part of (gemv_mem:
        lin_mem), which prices every step as that form did but for mixed steps' attention."""
        if len(self.samples) < 2 * len(DEVICE_FEATURES):
            self.correction = replace(self.correction, source=f"{self.correction.source}; "
                                      f"form-{form} coefficients, no samples to refit")
            return
        model = RooflineCostModel(self.model, get_gpu(self.gpu), 1, self.weight_dtype, self.kv_dtype,
                                  async_scheduling=self.async_scheduling)
        self.correction, fit = fit_correction(self.samples, model, f"{self.correction.source}; "
                                              f"refitted from its samples (form {form} -> {DEVICE_FORM})")
        self.fit = {**self.fit, **fit, "refitted_from_form": form}

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
            f.write("\n")


def load_table(path: str) -> CalibrationTable:
    with open(path, encoding="utf-8") as f:
        return CalibrationTable.from_json(json.load(f), path)


def shipped_tables(directory: str = TABLE_DIR) -> list[CalibrationTable]:
    """The tables that come with rooflm (rooflm/sim/calibrations/*.json)."""
    if not os.path.isdir(directory):
        return []
    return [load_table(os.path.join(directory, name)) for name in sorted(os.listdir(directory))
            if name.endswith(".json")]


# ---- fitting ------------------------------------------------------------------------------


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Non-negative least squares, min ||a x - b|| with x >= 0 (Lawson and Hanson's active
    set method). Small problems only: a handful of columns."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(iterations):
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit_correction(samples: list[StepSample], model: RooflineCostModel, source: str) -> tuple[Correction, dict]:
    """Fit device and host coefficients to measured steps; also return the fit's relative
    errors on its own samples (median and 90th percentile of |predicted / measured - 1|)."""
    if len(samples) < 2 * len(DEVICE_FEATURES):
        raise ValueError(f"{len(samples)} steps are too few to calibrate from")
    host_x = np.array([[1.0, s.num_seqs, s.shape.prefill_tokens] for s in samples])
    host_y = np.array([s.host_s for s in samples])
    host = nnls(host_x / host_y[:, None].clip(1e-6), np.ones(len(samples)))
    # A step that samples nothing (a prefill chunk that does not end its prompt, alone in the
    # batch) has no tokens to wait for: under async scheduling its time is read before the
    # device has run it (a 2048-token chunk "took" 5-10 ms of its ~45) and the next step's
    # carries it. Four such steps per grid, 4-9x off, outweighed hundreds of others in the
    # relative fit (fit error 12.4% median / 24.8% P90 with them, 3.9% / 9.7% without). Since
    # 4612f18 the engine waits for such a step under async scheduling, and they measure their own
    # time (46.6-47.6 ms, 0.9x the fitted one); they stay out so that older tables refit alike.
    device_rows = [s for s in samples if s.host_s < HOST_BOUND_SHARE * s.elapsed_s and s.shape.num_sampled]
    device_rows = device_rows or samples
    feats = np.array([model.features(s.shape)[0] for s in device_rows])
    y = np.array([s.elapsed_s for s in device_rows])
    # One GPU's steps cannot always tell a fixed cost per step from the weight read, which is
    # the same every step: weak prior rows settle that direction towards small fixed costs and
    # the roofline's own scale, so that a GPU that borrows this correction reads its weights at
    # its own bandwidth. The data outweighs them wherever it can tell.
    weight = PRIOR_WEIGHT * math.sqrt(len(device_rows))
    prior_a = np.diag([weight / PRIOR_FIXED_S, weight / PRIOR_FIXED_S] + [weight] * (len(DEVICE_FEATURES) - 2))
    prior_b = np.array([0.0, 0.0] + [weight] * (len(DEVICE_FEATURES) - 2))
    device = nnls(np.vstack([feats / y[:, None], prior_a]), np.concatenate([np.ones(len(device_rows)), prior_b]))
    correction = Correction(tuple(float(v) for v in device), tuple(float(v) for v in host), source)
    fitted = RooflineCostModel(model.model, model.gpu, model.tp, model.weight_dtype, model.kv_dtype,
                               correction, model.async_scheduling)
    errors = np.array([abs(fitted.step_seconds(s.shape, s.num_seqs) / s.elapsed_s - 1) for s in samples])
    return correction, {"steps": len(samples), "device_bound_steps": len(device_rows),
                        "median_rel_error": float(np.median(errors)),
                        "p90_rel_error": float(np.percentile(errors, 90))}


# ---- choosing a correction for a GPU ---------------------------------------------------------


def _gpu_distance(a: GpuSpec, b: GpuSpec) -> float:
    return math.hypot(math.log(a.mem_bw / b.mem_bw), math.log(a.peak_flops("bf16") / b.peak_flops("bf16")))


def correction_for(gpu: GpuSpec, model: ModelConfig, tables: list[CalibrationTable]) -> tuple[Correction, str]:
    """The correction to price `model` on `gpu` with, and a line saying where it is from:
    the GPU's own table (same model shape preferred), else the closest measured GPU's,
    else none (the datasheet roofline)."""
    if not tables:
        return Correction(), f"{gpu.key}: datasheet roofline, no calibration table (run rooflm simulate --calibrate)"

    def rank(t: CalibrationTable):
        return (_gpu_distance(gpu, get_gpu(t.gpu)), t.model != model)

    best = min(tables, key=rank)
    same_gpu = get_gpu(best.gpu).key == gpu.key
    shape = "same model shape" if best.model == model else f"measured with {best.model_name}"
    if same_gpu:
        return best.correction, f"{gpu.key}: calibrated ({best.device_name}, {shape})"
    borrowed = Correction(best.correction.device, best.correction.host,
                          f"borrowed from {best.gpu} ({best.device_name}, {shape}): {gpu.key} is not measured")
    return borrowed, f"{gpu.key}: datasheet roofline with the correction measured on {best.gpu} ({shape})"
