"""rooflm against llama.cpp on the CPU, side by side, on the same GGUF file.

    python benchmarks/cpu_vs_llamacpp.py                 # default model, 32 in / 64 out, 2 threads
    python benchmarks/cpu_vs_llamacpp.py --reps 7 --threads 1 --quantization none

What is measured: batch 1, a prompt of --input-len random token ids (the same ids for both
systems in a repetition, fresh ones every repetition), --output-len greedy tokens with EOS
ignored; tokens/s = output tokens / end-to-end time (prefill included), as `rooflm bench
latency` counts it. Each system runs in a worker process of its own that loads the model once
and then waits; the driver asks them in turn (rooflm, llama.cpp, rooflm, ...), so both meet the
same machine state, and reports the medians. On a shared machine the spread is large: read
the per-repetition numbers and the load averages saved with them.

llama.cpp is llama-cpp-python, installed on first use into .venv-llamacpp/ (git-ignored) with
pip; PyPI has only its source, so that first install compiles llama.cpp (minutes).

Writes benchmarks/results/cpu-<date>/cpu_vs_llamacpp.{json,md}, stamped with the date, CPU
model, commit and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_VENV = ROOT / ".venv-llamacpp"


# ---------------------------------------------------------------------------
# Workers: one process per system, one JSON line per request on stdin/stdout
# ---------------------------------------------------------------------------

def rooflm_worker(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    from rooflm import LLM, SamplingParams
    llm = LLM(model=args.model, device="cpu", quantization=args.quantization)

    def generate(ids, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return list(llm.generate(ids, params)[0].outputs[0].token_ids)

    serve(generate, {"torch": torch.__version__, "threads": torch.get_num_threads(),
                     "quantization": args.quantization})


def llamacpp_worker(args) -> None:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=512, n_batch=512, verbose=False, seed=0)

    def generate(ids, n):
        llm.reset()  # no reuse of the previous prompt's KV
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out

    serve(generate, {"llama_cpp_python": llama_cpp.__version__, "threads": args.threads})


def serve(generate, info) -> None:
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        tokens = generate(req["ids"], req["n"])
        elapsed = time.perf_counter() - t0
        print(json.dumps({"seconds": elapsed, "tokens": tokens}), flush=True)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

def ensure_llamacpp() -> Path:
    python = LLAMACPP_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import llama_cpp"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"installing llama-cpp-python into {LLAMACPP_VENV} (compiles llama.cpp: minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(LLAMACPP_VENV)], check=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "llama-cpp-python"], check=True, env=env)
    return python


class Worker:
    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, ids: list[int], n: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["rooflm", "llamacpp"], help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="measured repetitions per system")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quantization", default="auto", help="rooflm's --quantization (auto | none)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()

    if args.worker is not None:
        (rooflm_worker if args.worker == "rooflm" else llamacpp_worker)(args)
        return 0

    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from rooflm.model.loader import default_model_path
        args.model = default_model_path()
    llama_python = ensure_llamacpp()
    common = ["--model", args.model, "--threads", str(args.threads), "--quantization", args.quantization]
    here = str(Path(__file__).resolve())
    workers = [Worker("rooflm", [sys.executable, here, "--worker", "rooflm"] + common),
               Worker("llama.cpp", [str(llama_python), here, "--worker", "llamacpp"] + common)]
    rng = random.Random(0)
    runs: dict[str, list[float]] = {w.name: [] for w in workers}
    first_tokens: dict[str, list[int]] = {}
    loads = []
    try:
        for rep in range(args.warmup + args.reps):
            ids = [rng.randrange(1000, 40000) for _ in range(args.input_len)]
            loads.append(os.getloadavg()[0])
            order = workers if rep % 2 == 0 else workers[::-1]  # neither always goes first
            for w in order:
                res = w.run(ids, args.output_len)
                if len(res["tokens"]) != args.output_len:
                    raise RuntimeError(f"{w.name} gave {len(res['tokens'])} tokens, not {args.output_len}")
                tps = args.output_len / res["seconds"]
                if rep >= args.warmup:
                    runs[w.name].append(tps)
                    first_tokens.setdefault(w.name, res["tokens"])
                print(f"rep {rep}{' (warm-up)' if rep < args.warmup else ''}: {w.name:9s} {tps:7.1f} tok/s",
                      flush=True)
    finally:
        for w in workers:
            w.close()

    med = {name: statistics.median(v) for name, v in runs.items()}
    ratio = med["rooflm"] / med["llama.cpp"]
    a, b = first_tokens["rooflm"], first_tokens["llama.cpp"]
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds"), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "commit": commit(), "model": os.path.basename(args.model), "input_len": args.input_len,
        "output_len": args.output_len, "batch_size": 1, "threads": args.threads, "reps": args.reps,
        "rooflm": workers[0].info, "llama.cpp": workers[1].info,
        "tokens_per_s": runs, "median_tokens_per_s": med, "ratio_rooflm_over_llamacpp": ratio,
        "leading_greedy_tokens_equal": agree, "load_average_1min_per_rep": loads,
        "note": "machine shared with other jobs; per-repetition numbers and load averages kept",
    }
    out_dir = Path(args.out_dir or ROOT / "benchmarks" / "results" / f"cpu-{now:%Y%m%d}")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"cpu_vs_llamacpp-t{args.threads}-{args.quantization}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# rooflm vs llama.cpp on the CPU ({result['date']})", "",
          f"{result['cpu']}, {result['cpus']} CPUs, commit {result['commit']}; {result['model']}, "
          f"batch 1, {args.input_len} in / {args.output_len} out, greedy, {args.threads} threads, "
          f"rooflm --quantization {args.quantization}; {args.reps} interleaved repetitions, medians.",
          f"Machine shared with other jobs: 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
          f"during the run.", "",
          "| system | median tokens/s | per repetition |", "| --- | --- | --- |"]
    for name, values in runs.items():
        md.append(f"| {name} | {med[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    md += ["", f"rooflm / llama.cpp: {ratio:.2f}x. Greedy tokens of the first measured prompt equal "
               f"for the first {agree} of {args.output_len} (the two compute differently: llama.cpp "
               f"quantizes activations to 8 bits, rooflm to two 8-bit levels, or bf16 without its "
               f"native kernels).",
           "", f"Command: `python benchmarks/cpu_vs_llamacpp.py --threads {args.threads} --reps {args.reps} "
               f"--quantization {args.quantization}`", ""]
    stem.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
