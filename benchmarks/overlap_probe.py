"""Can decode attention run beside the GEMMs? A probe before building it into the engine.

One Llama-3-8B layer (hidden 4096, 32/8 heads, MLP 14336, bf16) at the shapes the ShareGPT-like
run has mid-way (~510 running sequences of ~330 tokens of context; mixed steps of ~1500 tokens):

  G(T)      the layer's four GEMMs (qkv, o, gate_up, down) for T tokens, cuBLAS
  A(S)      paged decode attention (rooflm's Triton kernel) for S sequences
  serial    G then A on one stream: what a step does today
  together  G on one stream, A on another, launched at once (either order): how well the two
            share the SMs and HBM when nothing orders them
  halves    NanoFlow's pipeline over two half batches: G(T/2) beside A(S/2), twice per layer,
            which re-reads the weights once more but can hide attention behind GEMMs
  carveoutK G limited to all SMs but K (torch._C._set_sm_carveout_experimental), alone and beside A

Bytes and FLOPs per layer are printed beside each time so the result reads against the roofline:
the overlapped floor is max(FLOPs / matmul rate, bytes / copy rate), the serial floor their sum.

    python benchmarks/overlap_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
REPS = 20
LAYERS = 8  # distinct weights per timed loop: the weights (436 MB a layer) never sit in L2


def layer_weights(n: int) -> list[dict]:
    def w(k, m):
        return torch.randn(k, m, dtype=DTYPE, device="cuda") * 0.02
    return [{"qkv": w(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": w(HIDDEN, HIDDEN),
             "gate_up": w(HIDDEN, 2 * FFN), "down": w(FFN, HIDDEN)} for _ in range(n)]


def gemms(x: torch.Tensor, w: dict, buf: dict) -> None:
    torch.mm(x, w["qkv"], out=buf["qkv"])
    torch.mm(x, w["o"], out=buf["o"])
    torch.mm(x, w["gate_up"], out=buf["gate_up"])
    torch.mm(buf["gate_up"][:, :FFN], w["down"], out=buf["down"])


def gemm_buffers(t: int) -> dict:
    e = lambda n: torch.empty(t, n, dtype=DTYPE, device="cuda")  # noqa: E731
    return {"x": torch.randn(t, HIDDEN, dtype=DTYPE, device="cuda"), "qkv": e((HEADS + 2 * KV_HEADS) * HEAD_DIM),
            "o": e(HIDDEN), "gate_up": e(2 * FFN), "down": e(HIDDEN)}


def attention_set(num_seqs: int, ctx: int, seed: int):
    from rooflm.kernels.decode_attention import decode_attention, plan_decode_attention
    from tests.kernels.helpers import random_paged_batch

    torch.manual_seed(seed)
    meta, k, v = random_paged_batch([ctx] * num_seqs, [1] * num_seqs, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE,
                                    "cuda", poison_unused=False)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    plan = plan_decode_attention(q, k, v, meta)
    scale = HEAD_DIM ** -0.5
    return lambda: decode_attention(q, k, v, meta, scale, out=out, plan=plan)


CARVEOUTS = (8, 16, 32, 48)


class sm_carveout:
    """torch's experimental cuBLAS SM-count target (None: all SMs); yields whether it exists."""

    def __init__(self, k: int):
        self.k = k

    def __enter__(self) -> bool:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            return False
        setter(self.k)
        return True

    def __exit__(self, *exc) -> None:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is not None:
            setter(None)


def timed(fn) -> float:
    """Median ms of one call of fn (fn launches on any streams; it joins them itself)."""
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(name: str, tokens: int, num_seqs: int, ctx: int, copy_gbps: float, mm_tflops: float) -> dict:
    weights = layer_weights(LAYERS)
    full, half = gemm_buffers(tokens), gemm_buffers(tokens // 2)
    # One attention set per layer so K/V (ctx * 4 KiB per sequence per layer) is never re-read from L2.
    attn_full = [attention_set(num_seqs, ctx, i) for i in range(LAYERS)]
    attn_half = [attention_set(num_seqs // 2, ctx, 100 + i) for i in range(2 * LAYERS)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def on(stream, fn):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
        main.wait_stream(stream)

    def g_only():
        for w in weights:
            gemms(full["x"], w, full)

    def a_only():
        for a in attn_full:
            a()

    def serial():
        for w, a in zip(weights, attn_full):
            gemms(full["x"], w, full)
            a()

    def together(attention_first: bool):
        def fn():
            s1.wait_stream(main)
            s2.wait_stream(main)
            for w, a in zip(weights, attn_full):
                first, second = ((s2, a), (s1, lambda w=w: gemms(full["x"], w, full)))[:: 1 if attention_first else -1]
                with torch.cuda.stream(first[0]):
                    first[1]()
                with torch.cuda.stream(second[0]):
                    second[1]()
            main.wait_stream(s1)
            main.wait_stream(s2)
        return fn

    def halves_serial():
        for i, w in enumerate(weights):
            for j in range(2):
                gemms(half["x"], w, half)
                attn_half[2 * i + j]()

    def halves_overlapped():
        # Pipeline: the GEMMs of half b run beside the attention of half a (one event per hand-off).
        s1.wait_stream(main)
        s2.wait_stream(main)
        for i, w in enumerate(weights):
            for j in range(2):
                with torch.cuda.stream(s1):
                    gemms(half["x"], w, half)
                    ev = torch.cuda.Event()
                    ev.record(s1)
                with torch.cuda.stream(s2):
                    s2.wait_event(ev)
                    attn_half[2 * i + j]()
        main.wait_stream(s1)
        main.wait_stream(s2)

    variants = {"G": g_only, "A": a_only, "serial": serial, "together_gemm_first": together(False),
                "together_attention_first": together(True), "halves_serial": halves_serial,
                "halves_overlapped": halves_overlapped}
    for fn in variants.values():  # warm-up: autotune, cuBLAS heuristics, Triton compile
        fn()
    torch.cuda.synchronize()
    ms = {k: timed(fn) / LAYERS * 1e3 for k, fn in variants.items()}  # us per layer
    # The GEMMs limited to 132 - k SMs (cuBLAS's SM-count target), so that attention's programs
    # find k SMs free beside them instead of waiting for the GEMM to retire.
    for k in CARVEOUTS:
        with sm_carveout(k) as ok:
            if not ok:
                break
            g, t = lambda: g_only(), together(False)
            g(), t()
            torch.cuda.synchronize()
            ms[f"G_carveout{k}"] = timed(g) / LAYERS * 1e3
            ms[f"together_carveout{k}"] = timed(t) / LAYERS * 1e3
    flops = 2 * tokens * (HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HIDDEN * HIDDEN + HIDDEN * 2 * FFN + FFN * HIDDEN)
    w_bytes = 2 * (HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HIDDEN * HIDDEN + HIDDEN * 2 * FFN + FFN * HIDDEN)
    kv_bytes = num_seqs * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    floors = {"gemm_compute_us": flops / mm_tflops / 1e6, "weights_us": w_bytes / copy_gbps / 1e3,
              "kv_us": kv_bytes / copy_gbps / 1e3}
    floors["serial_floor_us"] = max(floors["gemm_compute_us"], floors["weights_us"]) + floors["kv_us"]
    floors["overlapped_floor_us"] = max(floors["gemm_compute_us"], floors["weights_us"] + floors["kv_us"])
    floors["halves_floor_us"] = max(floors["gemm_compute_us"], 2 * floors["weights_us"] + floors["kv_us"])
    return {"case": name, "tokens": tokens, "num_seqs": num_seqs, "ctx": ctx, "us_per_layer": ms, **floors}


def ceilings() -> tuple[float, float]:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    mm = timed(lambda: torch.mm(a, b))
    return 2 * src.numel() / ms / 1e6, 2 * 8192 ** 3 / mm / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy_gbps, mm_tflops = ceilings()
    cases = [("mixed 1536 tok + 512 seqs", 1536, 512, 330), ("mixed 1024 tok + 512 seqs", 1024, 512, 330),
             ("decode 512 seqs", 512, 512, 330), ("decode 256 seqs x 1024", 256, 256, 1024)]
    rows = [run_case(n, t, s, c, copy_gbps, mm_tflops) for n, t, s, c in cases]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": copy_gbps,
              "matmul_TFLOPs": mm_tflops, "commit": os.environ.get("ROOFLM_COMMIT", "unknown"), "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "overlap_probe.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"copy {copy_gbps:.0f} GB/s, matmul {mm_tflops:.0f} TFLOP/s; us per layer")
    keys = ["G", "A", "serial", "together_gemm_first", "together_attention_first", "halves_serial",
            "halves_overlapped"] + [f"{v}_carveout{k}" for k in CARVEOUTS for v in ("G", "together")]
    print("| case | " + " | ".join(keys) + " | serial floor | overlapped floor | halves floor |")
    for r in rows:
        u = r["us_per_layer"]
        print(f"| {r['case']} | " + " | ".join(f"{u[k]:.0f}" if k in u else "-" for k in keys)
              + f" | {r['serial_floor_us']:.0f} | {r['overlapped_floor_us']:.0f} | {r['halves_floor_us']:.0f} |")


if __name__ == "__main__":
    main()
