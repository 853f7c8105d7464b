"""The short table of benchmarks/train.sh: rooflm's best training step beside HF transformers', peak
memory beside `rooflm memory --train`, the verdicts, then the knob table. Usage: train_report.py OUT"""

import json
import os
import sys

RUNS = (("hf_eager.json", "HF transformers, eager"), ("hf_compile.json", "HF transformers, compiled"),
        ("train_compile.json", "rooflm train: bf16, compile, fused AdamW"),
        ("train_cudnn.json", "rooflm train: the same, cuDNN attention first"),
        ("train_fsdp.json", "rooflm train: the same + FSDP2 (world of one)"))


def main(out: str) -> None:
    rows = []
    for name, label in RUNS:
        path = os.path.join(out, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                rows.append((label, json.load(f)))
    print("| run | tokens/s | MFU | peak GiB | memory --train GiB | with the recipe's fp32 grads |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, r in rows:
        predicted = r.get("predicted_memory_bytes")
        recipe = r.get("predicted_memory_recipe_bytes")
        print(f"| {label} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_bytes'] / 2**30:.1f} | "
              f"{'' if predicted is None else f'{predicted / 2**30:.1f}'} | "
              f"{'' if recipe is None else f'{recipe / 2**30:.1f}'} |")
    for label, r in rows:
        if r.get("phases_s"):
            print(f"{label}: phases " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["phases_s"].items()))
        if r.get("verdict"):
            print(f"{label}: {r['verdict']}")
    table = os.path.join(out, "bench_train.md")
    if os.path.exists(table):
        with open(table, encoding="utf-8") as f:
            print("\nknob table:\n" + f.read())


if __name__ == "__main__":
    main(sys.argv[1])
