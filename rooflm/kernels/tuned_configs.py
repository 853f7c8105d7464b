"""Measured tile tables for the weight-only kernels, per GPU: what pick_config reads first.

Why
---
The fastest tiles of a bandwidth-bound GEMV depend on the layer's shape, the batch and the GPU
(SM count, HBM), and a heuristic written without the GPU guesses. benchmarks/quant_gemv_sweep.py
times candidate configs on the real shapes and writes the best per (kernel, N, K, group, M) into
rooflm/kernels/tuned/weight_only.json under the GPU's name; this module looks them up.

Table
-----
  {"<torch.cuda.get_device_name()>": {"w4a16": [entry, ...], "w8a16": [entry, ...]}}
  entry = {"n": N, "k": K, "group": g (w4a16 only), "m": M, "config": {field: value}, ...}
A call with batch M takes the entry of the smallest tabled M >= M (the largest when M is beyond
the table): tiles chosen for batch 16 serve 5..16.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned", "weight_only.json")
# The batch-1 bf16/fp16 GEMV's launch shapes (kernels/gemv.py), written by benchmarks/gemv_shapes.py:
#   {"<gpu>": {"gemv": [{"n": N, "k": K, "gated": bool, "config": GemvConfig fields}, ...]}}
GEMV_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned", "gemv.json")


@functools.lru_cache(maxsize=4)
def load_table(path: str = TABLE_PATH) -> dict:
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object keyed by GPU name")
    return table


def lookup(kernel: str, device_name: Optional[str], n: int, k: int, m: int, group: Optional[int] = None,
           table: Optional[dict] = None) -> Optional[dict]:
    """The tabled config fields for this call, or None (no table for the GPU, or no entry for the shape)."""
    if device_name is None:
        return None
    table = load_table() if table is None else table
    entries = [e for e in table.get(device_name, {}).get(kernel, [])
               if e["n"] == n and e["k"] == k and (group is None or e.get("group") == group)]
    if not entries:
        return None
    above = [e for e in entries if e["m"] >= m]
    best = min(above, key=lambda e: e["m"]) if above else max(entries, key=lambda e: e["m"])
    return best["config"]


@functools.lru_cache(maxsize=256)
def lookup_gemv(device_name: str, n: int, k: int, gated: bool, path: str = GEMV_TABLE_PATH) -> Optional[dict]:
    """The tabled GEMV config fields for an [n, k] weight (n: output rows, after gating), or None.
    Cached: pick_config asks once per layer shape, not per call."""
    if not os.path.exists(path):
        return None
    for e in load_table(path).get(device_name, {}).get("gemv", []):
        if e["n"] == n and e["k"] == k and bool(e.get("gated")) == gated:
            return dict(e["config"])
    return None


@functools.lru_cache(maxsize=4)
def _device_facts(index: int) -> tuple[str, int]:
    import torch
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def device_facts(device) -> tuple[Optional[str], int]:
    """(GPU name, the table's key; SM count) of a torch device; (None, 132) off CUDA (the
    interpreter: no table, the heuristic sized for an H100's 132 SMs)."""
    if device.type != "cuda":
        return None, 132
    import torch
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())
