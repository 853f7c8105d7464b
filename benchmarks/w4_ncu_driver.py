"""Run the W4A16 kernel on Llama-3-8B's four linears at batch 1, a few times each, for Nsight Compute.

Usage (GPU): python benchmarks/w4_ncu_driver.py            (time and GB/s of each shape)
             W4_TIME=0 ncu --clock-control none -k regex:_w4a16 --launch-count 12 \
                 --section SpeedOfLight --section WarpStateStats python benchmarks/w4_ncu_driver.py
With W4_TIME=0 each shape launches 3 times (qkv, o, gate_up, down in turn): every third profiled
launch is a warm one. W4_SHAPES=gate_up,down: only those shapes; W4_CONFIG='{"block_m": 1, ...}':
that W4Config (JSON fields) instead of the table's, for every shape run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import json  # noqa: E402

from rooflm.kernels.w4a16 import W4Config, pack_int4, pick_config, w4a16_bytes, w4a16_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    torch.manual_seed(0)
    timing = os.environ.get("W4_TIME", "1") == "1"
    only = os.environ.get("W4_SHAPES")
    config = W4Config(**json.loads(os.environ["W4_CONFIG"])) if os.environ.get("W4_CONFIG") else None
    for name, (n, k) in SHAPES.items():
        if only and name not in only.split(","):
            continue
        qw = pack_int4(torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8), 128)
        s = (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
        z = torch.randint(0, 16, (k // 128, n), device="cuda").to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            w4a16_linear(x, qw, s, z, 128, config=config)
        torch.cuda.synchronize()
        if timing:
            us = triton.testing.do_bench(lambda: w4a16_linear(x, qw, s, z, 128, config=config), warmup=25,
                                         rep=100, return_mode="median") * 1e3
            print(f"{name:8} N={n} K={k} config={config or pick_config(1, n, k, 128)} {us:6.1f} us "
                  f"{w4a16_bytes(1, n, k, 128) / us / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
