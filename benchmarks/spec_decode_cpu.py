"""N-gram speculative decoding on the CPU with real weights (SmolLM2-135M): acceptance and speedup
on copy-heavy prompts (continue or edit a given text, code that repeats its identifiers) and on
open chat, one request at a time (batch 1), greedy. Plain and n-gram runs alternate per prompt,
in one process; the load average is printed beside the numbers (the machine is shared).

    python benchmarks/spec_decode_cpu.py [--max-tokens 96] [--k 4] [--quantization none] [--policy budget]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rooflm import LLM, SamplingParams  # noqa: E402

PARAGRAPH = ("Speculative decoding lets a small proposer guess several tokens ahead. The large "
             "model then checks all of the guesses in a single forward pass and keeps the ones "
             "it agrees with. When the guesses are good, each pass yields several tokens instead "
             "of one, and the output is exactly what the large model would have written alone.")
CODE = ("class TokenBucket:\n    def __init__(self, capacity, refill_rate):\n"
        "        self.capacity = capacity\n        self.refill_rate = refill_rate\n"
        "        self.tokens = capacity\n\n    def take(self, count):\n"
        "        if count > self.tokens:\n            return False\n"
        "        self.tokens -= count\n        return True\n")
PROMPTS = {
    "copy": [
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Fix the spelling of 'singel' in this paragraph and return the whole paragraph:\n\n"
        f"{PARAGRAPH.replace('single', 'singel')}",
        f"Add a method refill(self, seconds) to this class and return the whole class:\n\n{CODE}",
    ],
    "chat": [
        "Tell me a short story about a lighthouse keeper.",
        "What are three benefits of regular exercise?",
        "Explain how a rainbow forms.",
    ],
}


def run(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0]
    return time.perf_counter() - t0, len(out.token_ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--policy", default="adaptive", choices=["adaptive", "budget"],
                    help="--speculative-policy of the n-gram engine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    common = dict(device="cpu", dtype="float32", quantization=args.quantization)
    plain = LLM(**common)
    spec = LLM(**common, speculative_method="ngram", num_speculative_tokens=args.k,
               speculative_policy=args.policy)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0, max_tokens=4)
    for llm in (plain, spec):
        run(llm, "Hi", warm)
    rows = []
    for kind, prompts in PROMPTS.items():
        totals = {"plain_s": 0.0, "spec_s": 0.0, "plain_tokens": 0, "spec_tokens": 0}
        before = spec.engine.snapshot().spec
        load = [os.getloadavg()[0]]
        for prompt in prompts:
            s, n = run(plain, prompt, params)
            totals["plain_s"] += s
            totals["plain_tokens"] += n
            s2, n2 = run(spec, prompt, params)
            totals["spec_s"] += s2
            totals["spec_tokens"] += n2
            print(f"{kind}: plain {n} tokens in {s:.1f} s, n-gram {n2} tokens in {s2:.1f} s",
                  file=sys.stderr, flush=True)
            load.append(os.getloadavg()[0])
        after = spec.engine.snapshot().spec
        drafts = after.num_drafts - before.num_drafts
        draft_tokens = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        row = {"prompts": kind, "plain_tok_s": totals["plain_tokens"] / totals["plain_s"],
               "spec_tok_s": totals["spec_tokens"] / totals["spec_s"],
               "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
               "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
               "draft_tokens": draft_tokens, "load_avg_1m": sum(load) / len(load), **totals}
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| prompts | plain tok/s | n-gram tok/s | speedup | acceptance | mean accepted length | "
          f"load avg (1 min) |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['prompts']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | {r['load_avg_1m']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
