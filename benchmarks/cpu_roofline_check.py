"""The CPU roofline's decode floor beside `rooflm bench latency`'s TPOT, default model, batch 1
(issue 52: "the bound is a real number near what `bench latency` measures").

    python benchmarks/cpu_roofline_check.py [--threads 1 2] [--out DIR]

For each thread count, runs exactly `rooflm bench latency --batch-size 1 --input-len 32
--output-len 64` (OMP_NUM_THREADS=N) and reads from its JSON the decode step floor it printed
(the roofline's: each operation at its own measured roof, perf/gpus.py) and the TPOT (median and
best iteration), and the load average before and after. Wall-clock, so a busy machine moves it:
an OpenMP step of 2 threads waits for its slowest thread. The test in CI that cannot be moved by
load is tests/models/test_cpu_roofline_measured.py (one thread, CPU seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "latency.json"
        load_before = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "rooflm", "bench", "latency", "--batch-size", "1",
                        "--input-len", "32", "--output-len", "64", "--disable-tqdm",
                        "--output-json", str(path)],
                       cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), check=True,
                       stdout=subprocess.DEVNULL)
        result = json.loads(path.read_text())
    floor = result["decode_floor_ms"]
    tpot = result["tpot_ms"]
    return {"threads": threads, "decode_floor_ms": floor, "tpot_median_ms": tpot["median"],
            "tpot_best_ms": tpot["min"], "median_over_floor": tpot["median"] / floor,
            "best_over_floor": tpot["min"] / floor, "roofs": result.get("bandwidth_source"),
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=None, help="write cpu_roofline_check.json here")
    args = parser.parse_args()
    rows = [run(n) for n in args.threads]
    print(f"{'threads':>7} {'floor ms':>9} {'TPOT med':>9} {'TPOT best':>9} {'med/floor':>9} "
          f"{'best/floor':>10} {'load':>10}")
    for r in rows:
        print(f"{r['threads']:>7} {r['decode_floor_ms']:>9.2f} {r['tpot_median_ms']:>9.2f} "
              f"{r['tpot_best_ms']:>9.2f} {r['median_over_floor']:>9.2f} {r['best_over_floor']:>10.2f} "
              f"{r['load_before']:>4.1f}-{r['load_after']:<4.1f}")
        print(f"        roofs: {r['roofs']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_roofline_check.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
