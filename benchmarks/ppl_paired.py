"""Window-paired comparison of `rooflm eval ppl --output-json` results on the same windows: for each
pair, the mean per-token logprob difference and its standard error over the scored windows (how
consistently one model beats the other across the text, i.e. whether a perplexity gap is signal).
--windows A:B restricts everything to windows A..B-1 of the runs (counted from the run's first window,
0-based; and prints each run's perplexity over them), e.g. the first 16 windows of a 32-window run.
A run may be several results joined by '+' (X.json+Y.json): their windows, in that order, as one run
(e.g. windows 0-31 from one `eval ppl` and 64-334 from another `--first-window 64` one); the parts must
have the same window size and cover disjoint windows (`first_window`, 0 where absent), and both sides of
a pair must join the same windows. Every window counts as one sample of the SE, wherever it came from.
Each pair also prints B's perplexity change against A, exp(d) - 1 for a gap of d nats/token, with its SE
in points (100 exp(d) SE(d)) and the one-sided 95% upper bound exp(d + 1.645 SE(d)) - 1.
Usage: python benchmarks/ppl_paired.py [--windows A:B] A.json[+A2.json] B.json[+B2.json] [C.json ...]"""

import argparse
import json
import math


def logprobs(spec: str) -> tuple[list[float], int, list[tuple[int, int]]]:
    """(per-position logprobs, windows, [(first window, count) of each part]) of 'X.json[+Y.json...]'."""
    lps: list[float] = []
    parts: list[tuple[int, int]] = []
    sizes = set()
    for path in spec.split("+"):
        d = json.load(open(path))
        first, count = d.get("first_window", 0), d["num_windows"]
        for f, c in parts:
            if first < f + c and f < first + count:
                raise SystemExit(f"{spec}: windows {first}..{first + count - 1} of {path} overlap windows {f}..{f + c - 1}")
        sizes.add(d["window"])
        parts.append((first, count))
        lps += [p["logprob"] for p in d["positions"]]
    if len(sizes) != 1:
        raise SystemExit(f"{spec}: the parts have different window sizes {sorted(sizes)}")
    return lps, sum(c for _, c in parts), parts


def window_range(spec: str, windows: int) -> tuple[int, int]:
    lo, hi = (int(x) for x in spec.split(":"))
    if not 0 <= lo < hi <= windows or hi - lo < 2:
        raise SystemExit(f"--windows {spec}: need 0 <= A < B <= {windows} and at least 2 windows")
    return lo, hi


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", default=None, help="A:B, windows A..B-1 only (default: all)")
    ap.add_argument("paths", nargs="+", help="eval ppl --output-json results; X.json+Y.json joins two")
    args = ap.parse_args(argv)
    paths = args.paths
    runs = {}
    for p in paths:
        lp, windows, parts = logprobs(p)
        runs[p] = (lp, windows, parts)
        if len(parts) > 1:
            print(f"{p}: windows {', '.join(f'{f}..{f + c - 1}' for f, c in parts)} ({windows}): ppl "
                  f"{math.exp(-sum(lp) / len(lp)):.4f} over {len(lp)} tokens")
    if args.windows:
        for p, (lp, windows, parts) in runs.items():
            per = len(lp) // windows
            lo, hi = window_range(args.windows, windows)
            runs[p] = (lp[lo * per:hi * per], hi - lo, parts)
            print(f"{p} windows {lo}..{hi - 1}: ppl {math.exp(-sum(runs[p][0]) / len(runs[p][0])):.4f} "
                  f"over {len(runs[p][0])} tokens")
    for i, a in enumerate(paths):
        for b in paths[i + 1:]:
            (la, windows, parts_a), (lb, _, parts_b) = runs[a], runs[b]
            if len(la) != len(lb) or parts_a != parts_b:
                raise SystemExit(f"{a} and {b} scored different positions ({len(la)} vs {len(lb)}, windows "
                                 f"{parts_a} vs {parts_b})")
            per = len(la) // windows
            diffs = [x - y for x, y in zip(la, lb)]  # > 0: a puts more mass on the text's token
            means = [sum(diffs[w * per:(w + 1) * per]) / per for w in range(windows)]
            m = sum(means) / windows
            se = math.sqrt(sum((x - m) ** 2 for x in means) / (windows - 1) / windows)
            print(f"{a} vs {b}: {m:+.4f} nats/token, window-paired SE {se:.4f} (t = {m / se:.1f}); "
                  f"perplexity change {100 * math.expm1(m):+.2f}% (SE {100 * math.exp(m) * se:.2f} points, "
                  f"one-sided 95% upper bound {100 * math.expm1(m + 1.645 * se):+.2f}%)")


if __name__ == "__main__":
    main()
