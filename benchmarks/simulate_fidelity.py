"""Simulated vs measured: replay measured runs through `rooflm simulate` and print the errors.

For each `rooflm bench serve` result file given, the simulator replays the same traffic (each
request's send time, prompt length and output tokens, from the file) on the calibration
table's GPU and engine configuration; for the offline `rooflm bench throughput` result, the
same 1000 requests all at once (the lengths bench throughput drew, redrawn with its seed).
Prints one table: throughput, median and P99 TTFT and TPOT, measured, simulated, error; where
the result has them, the server's own TTFT (its /metrics histogram, bench serve's
server_ttft_ms: no client in it) against the simulated engine's first tokens counted into the
same buckets (the streaming of tokens not in it), and the client's CPU load.

  python benchmarks/simulate_fidelity.py --calibration CAL.json --model-dir DIR \\
      --serve OUT/serve-rate16.json OUT/serve-rate45.json ... --offline OUT/offline.json --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm.cli import build_parser  # noqa: E402

TARGETS = {"median": 0.10, "throughput": 0.10, "p99": 0.20}


def simulate(extra: list[str], result_file: str) -> dict:
    args = build_parser().parse_args(["simulate", *extra, "--result-file", result_file])
    rc = args.func(args)
    if rc != 0:
        raise SystemExit(f"rooflm simulate {' '.join(extra)} failed ({rc})")
    with open(result_file, encoding="utf-8") as f:
        return json.load(f)["results"][0]


def offline_trace(offline: dict, vocab_size: int, path: str) -> None:
    """The requests bench throughput ran, all at t = 0."""
    from rooflm.bench.serve import random_requests

    samples = random_requests(offline["num_prompts"], offline["input_len"], offline["output_len"],
                              offline["range_ratio"], seed=offline.get("prompt_seed", 0), as_text=False,
                              vocab_size=vocab_size)
    rows = [{"arrival_s": 0.0, "prompt_len": s.prompt_len, "output_len": s.output_len} for s in samples]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f)


def row(name: str, figure: str, measured, simulated, target: float) -> list:
    if measured is None or simulated is None:
        return [name, figure, measured, simulated, None, "n/a"]
    err = simulated / measured - 1 if measured else float("inf")
    return [name, figure, measured, simulated, err, "ok" if abs(err) <= target else "MISS"]


def compare(name: str, measured: dict, sim: dict) -> list[list]:
    rows = [row(name, "output tok/s", measured["output_throughput"], sim["output_throughput"],
                TARGETS["throughput"])]
    for key, label in (("ttft_ms", "TTFT"), ("server_ttft_ms", "TTFT at the server"), ("tpot_ms", "TPOT")):
        # The server's TTFT against the simulated engine's (arrival to the first token out of the
        # engine, through the same histogram buckets); the client's against the simulated client's.
        m, s = measured.get(key), sim.get(key)
        if key == "server_ttft_ms" and not m:
            continue  # a result from before bench serve scraped /metrics
        for stat, target in (("median", TARGETS["median"]), ("p99", TARGETS["p99"])):
            rows.append(row(name, f"{label} {stat} ms", m and m[stat], s and s[stat], target))
    if "client_cpu_busy" in measured:  # the client's own load: a busy client inflates its TTFT
        rows.append([name, "client CPU busy", f"{measured['client_cpu_busy']:.0%}", None, None, "n/a"])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--serve", nargs="*", default=[], help="bench serve result files")
    p.add_argument("--offline", default=None, help="bench throughput --output-json file")
    p.add_argument("--max-model-len", default="4096")
    p.add_argument("--out", required=True)
    p.add_argument("--sim-args", default="", help="more `rooflm simulate` flags for the served runs, "
                   "e.g. \"--api-token-us 80 --api-request-us 500\"")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    common = ["--model", args.model_dir, "--calibration", args.calibration, "--max-model-len", args.max_model_len]
    rows = []
    for path in args.serve:
        with open(path, encoding="utf-8") as f:
            measured = json.load(f)
        name = f"serve {measured['request_rate']:g} req/s" if measured.get("request_rate") else "serve inf"
        stem = os.path.splitext(os.path.basename(path))[0]
        sim = simulate(["--trace", path, *common, *args.sim_args.split()], os.path.join(args.out, f"sim-{stem}.json"))
        rows += compare(name, measured, sim)
    if args.offline:
        with open(args.offline, encoding="utf-8") as f:
            offline = json.load(f)
        offline = offline.get("result", offline)
        with open(os.path.join(args.model_dir, "config.json"), encoding="utf-8") as f:
            vocab = json.load(f)["vocab_size"]
        trace = os.path.join(args.out, "offline-trace.json")
        offline_trace(offline, vocab, trace)
        sim = simulate(["--trace", trace, "--ingress-ms", "0", "--api-token-us", "0", *common], os.path.join(args.out, "sim-offline.json"))
        rows.append(row("offline (bench throughput)", "output tok/s", offline["output_tokens_per_s"],
                        sim["output_throughput"], TARGETS["throughput"]))
        rows.append(row("offline (bench throughput)", "steps", offline.get("num_steps"),
                        sim["sim"]["steps"], TARGETS["throughput"]))

    from rooflm.perf.results import markdown_table

    headers = ["workload", "figure", "measured", "simulated", "error", "target"]
    shown = [[r[0], r[1], r[2], r[3], None if r[4] is None else f"{r[4]:+.1%}", r[5]] for r in rows]
    table = markdown_table(headers, shown)
    with open(os.path.join(args.out, "fidelity.md"), "w", encoding="utf-8") as f:
        f.write("# rooflm simulate vs measured (targets: throughput and medians within 10%, P99 within 20%)\n\n")
        f.write(table)
    with open(os.path.join(args.out, "fidelity.json"), "w", encoding="utf-8") as f:
        json.dump([dict(zip(headers, r)) for r in rows], f, indent=1)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
