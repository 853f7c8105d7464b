"""Batch-1 weight GEMVs of a decode step: cuBLAS (F.linear) against rooflm's Triton gemv.

Each case is timed the way a decode step runs it: a CUDA graph that calls the
op on L different weights back to back (one per layer, so nothing is served
from L2), replayed R times between two CUDA events; time per call = total /
(R * L), launch gaps included. Bandwidth counts the weight bytes only.

Parts:
  sweep   plain GEMV launch configs on the four Llama-3-8B weight shapes
  layer   one decoder layer's GEMV chain, unfused (cuBLAS + the norm / SiLU /
          add kernels) against fused (four gemv calls), x 32 layers

    python benchmarks/gemv.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm.kernels.gemv import DEFAULT_CONFIG, GemvConfig, gemv  # noqa: E402
import rooflm.envs as envs  # noqa: E402
from rooflm.kernels.rmsnorm import rmsnorm  # noqa: E402
from rooflm.kernels.silu_mul import silu_mul  # noqa: E402

HIDDEN, INTER, VOCAB, Q, KV = 4096, 14336, 128256, 4096, 1024
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}


def time_graph(fn, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def sweep(layers: int, quick: bool) -> list[dict]:
    envs.put("ROOFLM_PDL", "1")  # as the engine runs them
    configs = [GemvConfig(*c) for c in itertools.product(
        (4, 8, 16), (256, 512, 1024), (4, 8), (1, 2, 3))]
    if quick:
        configs = [DEFAULT_CONFIG, GemvConfig(8, 512, 4, 2), GemvConfig(4, 1024, 4, 3), GemvConfig(2, 2048, 4, 2)]
    rows = []
    x = torch.randn(1, INTER, device="cuda", dtype=torch.bfloat16)
    for name in ("qkv", "o", "down", "lm_head"):
        n, k = SHAPES[name]
        count = 4 if name == "lm_head" else layers
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        xk = x[:, :k].contiguous()
        nbytes = n * k * 2
        t = time_graph(lambda: [torch.nn.functional.linear(xk, w) for w in ws]) / count
        rows.append({"shape": name, "impl": "cublas", "us": t * 1e6, "tb_s": nbytes / t / 1e12})
        for cfg in configs:
            try:
                t = time_graph(lambda: [gemv(xk, w, config=cfg) for w in ws]) / count
            except Exception as e:  # a config the compiler rejects (registers, shared memory)
                rows.append({"shape": name, "impl": f"gemv{tuple(cfg)}", "error": str(e)[:200]})
                continue
            rows.append({"shape": name, "impl": f"gemv{tuple(cfg)}", "config": list(cfg),
                         "us": t * 1e6, "tb_s": nbytes / t / 1e12})
        del ws
        torch.cuda.empty_cache()
        best = sorted((r for r in rows if r["shape"] == name and "us" in r), key=lambda r: r["us"])[:4]
        print(name, " | ".join(f"{r['impl']} {r['us']:.1f} us {r['tb_s']:.2f} TB/s" for r in best), flush=True)
    return rows


def layer_chain(layers: int, configs: dict[str, GemvConfig], pdl: bool) -> list[dict]:
    envs.put("ROOFLM_PDL", "1" if pdl else "0")
    dt, dev = torch.bfloat16, "cuda"
    mk = lambda *s: torch.randn(*s, device=dev, dtype=dt) * 0.02  # noqa: E731
    W = [{name: mk(*SHAPES[name]) for name in ("qkv", "o", "gate_up", "down")} for _ in range(layers)]
    ln = torch.ones(HIDDEN, device=dev, dtype=dt)
    h0 = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    attn = torch.randn(1, Q, device=dev, dtype=dt)
    F = torch.nn.functional

    def unfused():
        x, res = rmsnorm(h0, ln, 1e-5), h0
        for w in W:
            F.linear(x, w["qkv"])
            o = F.linear(attn, w["o"])
            x, res = rmsnorm(o, ln, 1e-5, res)
            d = F.linear(silu_mul(F.linear(x, w["gate_up"])), w["down"])
            x, res = rmsnorm(d, ln, 1e-5, res)

    def fused():
        h = h0
        for w in W:
            gemv(h, w["qkv"], norm_weight=ln, eps=1e-5, config=configs.get("qkv"))
            h = gemv(attn, w["o"], residual=h, config=configs.get("o"))
            a = gemv(h, w["gate_up"], norm_weight=ln, eps=1e-5, gated=True, config=configs.get("gate_up"))
            h = gemv(a, w["down"], residual=h, config=configs.get("down"))

    nbytes = sum(w.numel() * 2 for w in W[0].values()) * layers
    rows = []
    tag = f" [{'tuned' if configs else 'default'} configs, PDL {'on' if pdl else 'off'}]"
    for name, fn in (("unfused (cuBLAS + norm/silu/add kernels)" + tag, unfused), ("fused gemv" + tag, fused)):
        t = time_graph(fn, reps=10)
        rows.append({"chain": name, "layers": layers, "ms": t * 1e3, "tb_s": nbytes / t / 1e12})
        print(f"layer chain x{layers}: {name}: {t * 1e3:.3f} ms, {nbytes / t / 1e12:.2f} TB/s", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    rows = sweep(args.layers, args.quick)
    best = {}
    for name in ("qkv", "o", "down"):
        cands = sorted((r for r in rows if r["shape"] == name and "config" in r), key=lambda r: r["us"])
        best[name] = GemvConfig(*cands[0]["config"])
    best["gate_up"] = best["qkv"]
    chains = (layer_chain(args.layers, {}, False) + layer_chain(args.layers, {}, True)
              + layer_chain(args.layers, best, True))
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "commit": os.environ.get("ROOFLM_COMMIT", "unknown"),
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "sweep": rows, "best": {k: list(v) for k, v in best.items()}, "chains": chains,
              "seconds": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gemv-" + gpu.lower().replace(" ", "-") + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("best configs:", best)
    for c in chains:
        print(f"  {c['chain']:75s} {c['ms']:.3f} ms  {c['tb_s']:.2f} TB/s")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
