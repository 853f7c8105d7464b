"""Window-paired comparison of `rooflm eval ppl --output-json` results on the same windows: for each
pair, the mean per-token logprob difference and its standard error over the scored windows (how
consistently one model beats the other across the text, i.e. whether a perplexity gap is signal).
Usage: python benchmarks/ppl_paired.py A.json B.json [C.json ...]"""

import json
import math
import sys


def logprobs(path: str) -> tuple[list[float], int]:
    d = json.load(open(path))
    return [p["logprob"] for p in d["positions"]], d["num_windows"]


def main(paths: list[str]) -> None:
    runs = {p: logprobs(p) for p in paths}
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
    main(sys.argv[1:])
