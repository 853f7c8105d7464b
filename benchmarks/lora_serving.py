"""Issue 49's multi-LoRA targets in one run: adapters against the base model on the same shape.

Usage (GPU, the issue's setting: Llama-3-8B shape, dummy bf16 base, 16 random rank-16 adapters on
all seven projections):
    PYTHONPATH=$PWD python benchmarks/lora_serving.py --output-json /tmp/lora.json
Usage (CPU, end to end on a small shape, numbers meaningless):
    PYTHONPATH=$PWD python benchmarks/lora_serving.py --tiny

What it measures (the base engine has no --enable-lora; the LoRA engine serves the adapters):
  1. decode TPOT at batch B (64) with the adapters mixed (B / N requests each) against the base
     model's; and at batch 1 under one adapter against the base model's. TPOT is the median
     wall time of the steps that decode all B sequences (StepReport.timings.elapsed_s: between
     results under async scheduling), so prefill never enters it.
  2. offline throughput of a ShareGPT-like workload (--num-prompts requests, prompt ~230 and
     output ~200 tokens uniform +-90%, as DESIGN.md's offline row) with request i under adapter
     i mod N, against the same requests on the base model: total (prompt + output) tokens/s.
  3. adapter swap: a cold adapter from the host cache, and one read from disk, to serving.
     Direct: the slot copy alone (LoRAManager.activate of an adapter in the host cache but in no
     slot), and disk read + check + slot image + copy (a new LoRARequest). End to end: a 16-token
     request's admission-to-first-token under a resident adapter, a host-cold one and a
     disk-cold one; the swap's cost is the difference. "Disk" is the page cache here: the
     adapters were written by this run.
Adapters are PEFT directories (adapter_config.json + adapter_model.safetensors) of random A and B
(B non-zero, so the adapters change the output), written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rooflm import LLM, SamplingParams  # noqa: E402
from rooflm.bench.serve import random_requests  # noqa: E402
from rooflm.lora.adapter import PROJECTIONS, load_adapter, projection_shape  # noqa: E402
from rooflm.lora.request import LoRARequest  # noqa: E402

TARGETS = {"tpot_mixed": 1.10, "tpot_b1": 1.08, "throughput": 0.85, "swap_host_ms": 5.0, "swap_disk_ms": 100.0}


# ---------------------------------------------------------------- adapters


def write_peft_adapter(path: str, model_config, rank: int, alpha: float, seed: int, dtype: torch.dtype) -> None:
    """A PEFT LoRA directory of random A and B on all seven projections of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for proj in PROJECTIONS:
            out_f, in_f = projection_shape(model_config, proj)
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) / in_f ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) / rank ** 0.5 * 0.05).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(PROJECTIONS),
              "bias": "none", "use_rslora": False, "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


# ---------------------------------------------------------------- measurements


def sync(llm) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def run_requests(llm, prompts, output_lens, loras, tag: str) -> tuple[float, list]:
    """Submit every request at once, step until all are done; (seconds, step reports)."""
    engine = llm.engine
    reports = []
    engine.add_observer(reports.append)
    sync(llm)
    start = time.perf_counter()
    for i, (prompt, out_len, lora) in enumerate(zip(prompts, output_lens, loras)):
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, output_kind="final")
        engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()
    sync(llm)
    elapsed = time.perf_counter() - start
    engine.remove_observer(reports.append)
    return elapsed, reports


def decode_tpot(llm, batch: int, prompt_len: int, tokens: int, loras, seed: int) -> dict:
    """Median ms of the steps that decode all `batch` sequences, and how they ran."""
    reqs = random_requests(batch, prompt_len, tokens, 0.0, seed=seed, vocab_size=llm.engine.model_config.vocab_size)
    _, reports = run_requests(llm, [r.prompt for r in reqs], [tokens] * batch, loras, f"tpot{seed}")
    steps = [r for r in reports if r.kind == "decode" and r.num_seqs == batch]
    if not steps:
        raise RuntimeError(f"no step decoded all {batch} sequences at once")
    graphs = sorted({r.graph for r in steps})
    return {"tpot_ms": statistics.median(r.timings.elapsed_s for r in steps) * 1e3, "steps": len(steps),
            "paths": graphs}


def offline_throughput(llm, requests, loras, tag: str) -> dict:
    elapsed, _ = run_requests(llm, [r.prompt for r in requests], [r.output_len for r in requests], loras, tag)
    prompt = sum(len(r.prompt) for r in requests)
    output = sum(r.output_len for r in requests)
    return {"elapsed_s": elapsed, "total_tok_s": (prompt + output) / elapsed, "output_tok_s": output / elapsed}


def first_token_ms(llm, lora, tag: str, vocab: int) -> float:
    """A 16-token prompt's admission (add_request: a disk-cold adapter is read there) to its
    first token."""
    prompt = random_requests(1, 16, 1, 0.0, seed=hash(tag) % 10_000, vocab_size=vocab)[0].prompt
    engine = llm.engine
    sync(llm)
    t0 = time.perf_counter()
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=1, output_kind="final"),
                       lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()
    sync(llm)
    return (time.perf_counter() - t0) * 1e3


def swap_latency(llm, main: list, extra_paths: list[str], next_id: int, trials: int) -> dict:
    manager = llm.engine.runner.lora
    vocab = llm.engine.model_config.vocab_size
    resident = [first_token_ms(llm, main[0], f"resident-{j}", vocab) for j in range(trials)]
    copy_ms, host_ms, disk_load_ms, disk_ms, read_ms, image_ms = [], [], [], [], [], []
    for j in range(trials):
        path = extra_paths[j % len(extra_paths)]
        cold = LoRARequest(f"host-cold-{j}", next_id, path)
        next_id += 1
        manager.load(cold)  # in the host cache
        manager.activate(main)  # ... and in no slot (main fills every slot)
        sync(llm)
        t0 = time.perf_counter()
        manager.activate([cold])
        sync(llm)
        copy_ms.append((time.perf_counter() - t0) * 1e3)
        manager.activate(main)  # cold again
        host_ms.append(first_token_ms(llm, cold, f"host-{j}", vocab))
        # A fresh request: read from disk (the page cache) in add_request, then copied.
        fresh = LoRARequest(f"disk-cold-{j}", next_id, path)
        next_id += 1
        sync(llm)
        t0 = time.perf_counter()
        manager.activate([fresh])
        sync(llm)
        disk_load_ms.append((time.perf_counter() - t0) * 1e3)
        # The disk load's parts: the file mapped and checked, then its slot image built.
        t0 = time.perf_counter()
        adapter = load_adapter(f"parts-{j}", path, manager.model_config, manager.config.max_lora_rank)
        t1 = time.perf_counter()
        manager.slot_image(adapter)
        read_ms.append((t1 - t0) * 1e3)
        image_ms.append((time.perf_counter() - t1) * 1e3)
        del adapter
        fresh_e2e = LoRARequest(f"disk-e2e-{j}", next_id, path)
        next_id += 1
        manager.activate(main)
        disk_ms.append(first_token_ms(llm, fresh_e2e, f"disk-{j}", vocab))
    med = statistics.median
    return {"resident_ttft_ms": med(resident), "host_copy_ms": med(copy_ms), "host_ttft_ms": med(host_ms),
            "host_extra_ms": med(host_ms) - med(resident), "disk_load_copy_ms": med(disk_load_ms),
            "disk_ttft_ms": med(disk_ms), "disk_extra_ms": med(disk_ms) - med(resident),
            "disk_read_check_ms": med(read_ms), "disk_image_ms": med(image_ms)}


# ---------------------------------------------------------------- the run


def model_config_of(args):
    """The model's config (no engine): its shape for the adapters, its vocabulary for the prompts."""
    from rooflm.model.loader import load_model_config, resolve_model

    return load_model_config(*resolve_model(args.model, "dummy"))


def engine_kwargs(args) -> dict:
    return dict(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device,
                max_model_len=args.max_model_len, max_num_seqs=max(args.batch, args.max_num_seqs),
                **({"gpu_memory_utilization": args.gpu_memory_utilization} if args.device == "cuda" else {}))


def release(llm) -> None:
    """The engine's graphs and device memory back before the next engine is built (the caller
    drops its last reference)."""
    llm.engine.runner.release_graphs()
    llm.shutdown()


def measure_base(args, offline) -> dict:
    base = LLM(**engine_kwargs(args))
    run_requests(base, [r.prompt for r in offline[:4]], [4] * 4, [None] * 4, "warm")
    result = {"b1": decode_tpot(base, 1, args.prompt_len, args.decode_tokens, [None], seed=11),
              "mixed": decode_tpot(base, args.batch, args.prompt_len, args.decode_tokens, [None] * args.batch,
                                   seed=12),
              "offline": offline_throughput(base, offline, [None] * len(offline), "offline-base")}
    release(base)
    return result


def measure_lora(args, offline, paths: list[str]) -> dict:
    main_loras = [LoRARequest(f"adapter{i}", i + 1, paths[i]) for i in range(args.num_adapters)]
    llm = LLM(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
              max_cpu_loras=args.num_adapters + 3 * args.swap_trials + 2, **engine_kwargs(args))
    # Every adapter read, checked and resident before the clock: the swap has its own rows.
    run_requests(llm, [r.prompt for r in offline[:args.num_adapters]], [4] * args.num_adapters, main_loras, "warm")
    mixed = [main_loras[i % args.num_adapters] for i in range(args.batch)]
    spread = [main_loras[i % args.num_adapters] for i in range(len(offline))]
    result = {"b1": decode_tpot(llm, 1, args.prompt_len, args.decode_tokens, [main_loras[0]], seed=11),
              "mixed": decode_tpot(llm, args.batch, args.prompt_len, args.decode_tokens, mixed, seed=12),
              "base_rows": decode_tpot(llm, args.batch, args.prompt_len, args.decode_tokens, [None] * args.batch,
                                       seed=13),
              "offline": offline_throughput(llm, offline, spread, "offline-lora"),
              "swap": swap_latency(llm, main_loras, paths[args.num_adapters:], 1000, args.swap_trials)}
    release(llm)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a preset or model directory (dummy weights)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="TPOT runs' prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=128, help="TPOT runs' output tokens")
    p.add_argument("--num-prompts", type=int, default=1000, help="offline throughput requests")
    p.add_argument("--input-len", type=int, default=230)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--range-ratio", type=float, default=0.9)
    p.add_argument("--swap-trials", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: smollm2-135m, fp32, batch 8, 4 adapters of rank 8, a few requests")
    p.add_argument("--output-json", default=None)
    p.add_argument("--part", choices=("all", "base", "lora"), default="all",
                   help="all: the base and the LoRA engine, each in a child process of its own")
    p.add_argument("--part-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.dtype, args.device = "smollm2-135m", "float32", "cpu"
        args.num_adapters, args.rank, args.batch = 4, 8, 8
        args.prompt_len, args.decode_tokens, args.num_prompts = 16, 5, 8
        args.input_len, args.output_len, args.swap_trials, args.max_model_len = 24, 6, 1, 256
    if args.batch % args.num_adapters:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --num-adapters {args.num_adapters}")
    dtype = getattr(torch, args.dtype)
    results: dict = {"args": vars(args)}

    if args.part == "all":
        # Each engine in its own process: the second then has the whole device, whatever the
        # first left behind (graph pools, the caching allocator).
        for part in ("base", "lora"):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv),
                                "--part", part, "--part-json", f.name], check=True)
                with open(f.name) as back:
                    results[part] = json.load(back)
    else:
        model_config = model_config_of(args)
        offline = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, seed=1,
                                  vocab_size=model_config.vocab_size)
        if args.part == "base":
            part = measure_base(args, offline)
        else:
            root = tempfile.mkdtemp(prefix="rooflm-lora-bench-")
            try:
                paths = [os.path.join(root, f"adapter{i}") for i in range(args.num_adapters + 2)]
                t0 = time.perf_counter()
                for i, path in enumerate(paths):
                    write_peft_adapter(path, model_config, args.rank, 2.0 * args.rank, seed=i, dtype=dtype)
                print(f"wrote {len(paths)} adapters to {root} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
                part = measure_lora(args, offline, paths)
            finally:
                shutil.rmtree(root, ignore_errors=True)  # ~84 MB an adapter at the 8B shape
        with open(args.part_json, "w") as f:
            json.dump(part, f)
        return 0
    print_table(results, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def print_table(results: dict, args) -> None:
    b, lo = results["base"], results["lora"]
    swap = lo["swap"]
    rows = [
        (f"decode TPOT, batch {args.batch}, {args.num_adapters} adapters mixed (ms)", b["mixed"]["tpot_ms"],
         lo["mixed"]["tpot_ms"], lo["mixed"]["tpot_ms"] / b["mixed"]["tpot_ms"], f"<= {TARGETS['tpot_mixed']}x",
         lo["mixed"]["tpot_ms"] / b["mixed"]["tpot_ms"] <= TARGETS["tpot_mixed"]),
        ("decode TPOT, batch 1, one adapter (ms)", b["b1"]["tpot_ms"], lo["b1"]["tpot_ms"],
         lo["b1"]["tpot_ms"] / b["b1"]["tpot_ms"], f"<= {TARGETS['tpot_b1']}x",
         lo["b1"]["tpot_ms"] / b["b1"]["tpot_ms"] <= TARGETS["tpot_b1"]),
        (f"offline {args.num_prompts} x ~{args.input_len}/~{args.output_len}, tokens/s", b["offline"]["total_tok_s"],
         lo["offline"]["total_tok_s"], lo["offline"]["total_tok_s"] / b["offline"]["total_tok_s"],
         f">= {TARGETS['throughput']}x",
         lo["offline"]["total_tok_s"] / b["offline"]["total_tok_s"] >= TARGETS["throughput"]),
        ("swap host cache -> serving (ms, TTFT over a resident adapter's)", swap["resident_ttft_ms"],
         swap["host_ttft_ms"], swap["host_extra_ms"], f"<= {TARGETS['swap_host_ms']} ms",
         swap["host_extra_ms"] <= TARGETS["swap_host_ms"]),
        ("swap disk -> serving (ms, TTFT over a resident adapter's)", swap["resident_ttft_ms"], swap["disk_ttft_ms"],
         swap["disk_extra_ms"], f"<= {TARGETS['swap_disk_ms']} ms", swap["disk_extra_ms"] <= TARGETS["swap_disk_ms"]),
    ]
    print(f"\n{args.model} ({args.dtype}, dummy), {args.num_adapters} adapters of rank {args.rank} on all seven "
          f"projections, {args.device}")
    print(f"| what | base | LoRA | LoRA/base or extra | target | met |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for what, base_v, lora_v, ratio, target, met in rows:
        print(f"| {what} | {base_v:.2f} | {lora_v:.2f} | {ratio:.3f} | {target} | {'yes' if met else 'NO'} |")
    print(f"| decode TPOT, batch {args.batch}, base requests on the LoRA engine (ms) | {b['mixed']['tpot_ms']:.2f} | "
          f"{lo['base_rows']['tpot_ms']:.2f} | {lo['base_rows']['tpot_ms'] / b['mixed']['tpot_ms']:.3f} | info | |")
    print(f"\nswap parts: slot copy from the host cache {swap['host_copy_ms']:.2f} ms; disk read + check + "
          f"image + copy {swap['disk_load_copy_ms']:.2f} ms (map + check {swap['disk_read_check_ms']:.2f} ms, "
          f"pinned image {swap['disk_image_ms']:.2f} ms)")
    print(f"decode paths: base {b['mixed']['paths']}, LoRA mixed {lo['mixed']['paths']}, "
          f"LoRA b1 {lo['b1']['paths']}")


if __name__ == "__main__":
    sys.exit(main())
