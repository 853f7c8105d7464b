"""Window-paired comparison of `rooflm eval ppl --output-json` results on the same windows: for each
pair, the mean per-token logprob difference and its standard error over the scored windows (how
consistently one model beats the other across the text, i.e. whether a perplexity gap is signal).
--windows A:B restricts everything to windows A..B-1 of the runs (and prints each run's perplexity
over them), e.g. the first 16 windows of a 32-window run.
Usage: python benchmarks/ppl_paired.py [--windows A:B] A.json B.json [C.json ...]"""

import argparse
import json
import math


def logprobs(path: str) -> tuple[list[float], int]:
    d = json.load(open(path))
    return [p["logprob"] for p in d["positions"]], d["num_windows"]


def window_range(spec: str, windows: int) -> tuple[int, int]:
    lo, hi = (int(x) for x in spec.split(":"))
    if not 0 <= lo < hi <= windows or hi - lo < 2:
        raise SystemExit(f"--windows {spec}: need 0 <= A < B <= {windows} and at least 2 windows")
    return lo, hi


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", default=None, help="A:B, windows A..B-1 only (default: all)")
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)
    paths = args.paths
    runs = {p: logprobs(p) for p in paths}
    if args.windows:
        for p, (lp, windows) in runs.items():
            per = len(lp) // windows
            lo, hi = window_range(args.windows, windows)
            runs[p] = (lp[lo * per:hi * per], hi - lo)
            print(f"{p} windows {lo}..{hi - 1}: ppl {math.exp(-sum(runs[p][0]) / len(runs[p][0])):.4f} "
                  f"over {len(runs[p][0])} tokens")
    for i, a in enumerate(paths):
        for b in paths[i + 1:]:
            (la, windows), (lb, _) = runs[a], runs[b]
            if len(la) != len(lb):
                raise SystemExit(f"{a} and {b} scored different positions ({len(la)} vs {len(lb)})")
            per = len(la) // windows
            diffs = [x - y for x, y in zip(la, lb)]  # > 0: a puts more mass on the text's token
            means = [sum(diffs[w * per:(w + 1) * per]) / per for w in range(windows)]
            m = sum(means) / windows
            se = math.sqrt(sum((x - m) ** 2 for x in means) / (windows - 1) / windows)
            print(f"{a} vs {b}: {m:+.4f} nats/token, window-paired SE {se:.4f} (t = {m / se:.1f})")


if __name__ == "__main__":
    main()
