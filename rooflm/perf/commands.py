"""The `rooflm roofline`, `memory` and `profile` subcommands: argument parsing and output."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional, TextIO

from rooflm.config import CUDA_BLOCK_SIZE, KV_OFFLOAD_AUTO_MAX_GB, ModelConfig
from rooflm.engine_args import add_engine_args
from rooflm.perf.gpus import GPUS, GpuSpec, get_gpu
from rooflm.perf.memory import inference_memory, training_memory, weight_bytes
from rooflm.perf.roofline import (
    KV_CACHE_BYTES,
    WEIGHT_FORMATS,
    engine_precision,
    expected_active_experts,
    kv_bytes_per_token_per_gpu,
    layer_roof,
    phase_step_cost,
    roofline,
    summarize,
    verdict,
)

GB = 1e9
MB = 1e6


def register(subparsers) -> None:
    """Add the `roofline`, `memory` and `profile` subcommands to an argparse subparsers object."""
    gpu_choices = sorted(GPUS) + ["measure"]
    roofline_devices = ["auto", "cpu"] + gpu_choices

    p = subparsers.add_parser(
        "roofline", help="FLOPs, bytes and floor time of every op of one forward step",
        description="Per-operation FLOPs, bytes moved, arithmetic intensity and floor time of "
                    "one forward step on a GPU's roofline, and the tokens/s ceiling that follows.")
    p.add_argument("--model", default=None, help="preset name, HF model directory or .gguf file "
                                                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gpu", default="auto", choices=roofline_devices,
                   help="datasheet peaks of a GPU, h100-measured for this project's H100, "
                        "'measure' to measure the present GPU (else the CPU), 'cpu' to measure this "
                        "CPU (SIMD FMA and DRAM roofs, the engine's CPU precision); default auto: the "
                        "visible GPU's datasheet, or this CPU measured when there is none")
    p.add_argument("--batch-size", type=int, default=1, help="sequences in the batch (default 1)")
    p.add_argument("--context", type=int, default=1024,
                   help="tokens per sequence: the prompt for prefill, the attended context for "
                        "decode (default 1024)")
    p.add_argument("--phase", choices=("prefill", "decode"), default="decode")
    p.add_argument("--dtype", choices=sorted(WEIGHT_FORMATS), default=None,
                   help="weight format (default: a GGUF file's own blocks where the engine keeps them, "
                        "e.g. q4_1 for the default model; otherwise bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--kv-cache-dtype", dest="kv_dtype", choices=KV_DTYPE_CHOICES, default="auto",
                   help="KV cache dtype, as the engine's flag (fp8_e4m3 is fp8); auto: bf16 on a GPU "
                        "(fp32 with fp32 weights), fp32 on a CPU")
    p.add_argument("--tensor-parallel-size", "-tp", dest="tp", type=int, default=1,
                   help="tensor-parallel GPUs (per-GPU figures, plus the all-reduces)")
    p.add_argument("--allreduce-latency-us", type=float, default=None,
                   help="fixed cost of one all-reduce with -tp > 1 (default: an NVLink estimate; "
                        "benchmarks/tp.sh measures it)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw the roofline chart")
    p.set_defaults(func=run_roofline)

    p = subparsers.add_parser(
        "memory", help="memory plan: weights, KV cache, concurrent sequences; --train for training",
        description="Inference: weight bytes, KV bytes per token, blocks and concurrent sequences "
                    "that fit. --train: weights, gradients, Adam moments, fp32 master weights and "
                    "activations per GPU under DDP and FSDP.")
    p.add_argument("--model", default=None, help="preset name, HF model directory or .gguf file "
                                                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=sorted(WEIGHT_FORMATS), default=None,
                   help="weight format (default: a GGUF file's own blocks where the engine keeps them, "
                        "e.g. q4_1 for the default model; otherwise bf16; training: bf16, fp16 or fp32, "
                        "default bf16)")
    p.add_argument("--kv-cache-dtype", dest="kv_dtype", choices=KV_DTYPE_CHOICES, default="auto",
                   help="KV cache dtype, as the engine's flag (fp8_e4m3 is fp8); auto: bf16, or fp32 "
                        "with fp32 weights")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence (default: the model's maximum, at most 8192); "
                        "with --train, the training sequence length (default 2048)")
    p.add_argument("--gpu-mem", type=float, default=None, metavar="GB",
                   help="GPU memory in GB (default: that of --gpu, else 80)")
    p.add_argument("--gpu", default=None, choices=sorted(GPUS), help="take --gpu-mem from this GPU")
    p.add_argument("--tensor-parallel-size", "-tp", dest="tp", type=int, default=1,
                   help="tensor-parallel GPUs (inference: per-GPU figures)")
    p.add_argument("--pipeline-parallel-size", "-pp", dest="pp", type=int, default=1,
                   help="pipeline stages (inference: each stage's weights and KV; the figures are the "
                        "stage with the fewest KV blocks)")
    p.add_argument("--block-size", type=int, default=CUDA_BLOCK_SIZE,
                   help=f"KV cache block size in tokens (default: {CUDA_BLOCK_SIZE}, the engine's CUDA default)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="scheduler token budget, sizes the activation reserve")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequence cap, sizes the logits in the activation reserve (default: the "
                        "engine's default on a GPU of --gpu-mem)")
    p.add_argument("--kv-offload-gb", type=float, default=None, metavar="GIB",
                   help="the prefix cache's host tier, as the engine's flag (default: the engine's "
                        "CUDA cap, a tenth of the host's available memory up to that)")
    p.add_argument("--train", action="store_true", help="training memory instead of inference")
    p.add_argument("--num-gpus", type=int, default=8, help="GPUs for DDP / FSDP (with --train)")
    p.add_argument("--batch-size", type=int, default=1, help="micro-batch per GPU (with --train)")
    p.add_argument("--no-flash-attention", action="store_true",
                   help="eager attention: activations keep the softmax matrix (with --train)")
    p.set_defaults(func=run_memory)

    _register_profile(subparsers, gpu_choices)


def _register_profile(subparsers, gpu_choices: list[str]) -> None:
    """`rooflm profile`: torch.profiler trace of real engine steps, and what limits them."""

    p = subparsers.add_parser(
        "profile", help="profile engine steps: Chrome trace, time by phase and kernel, verdict",
        description="Runs B requests of P random token ids through the engine, times S steps, "
                    "profiles S more with torch.profiler (Chrome trace in --output), and says "
                    "whether the steps are CPU/launch-, memory-, compute- or KV-capacity-bound.")
    p.add_argument("--batch-size", type=int, default=1, help="concurrent requests (default 1)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=None,
                   help="max output tokens per request (default: enough for every step)")
    p.add_argument("--steps", type=int, default=20,
                   help="steps timed, then as many profiled (default 20)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps before timing (default: until every prompt is in and 3 decode "
                        "steps ran, so the profile is of steady decoding; give a number to "
                        "profile prefill steps)")
    p.add_argument("--output", default="rooflm-profile", metavar="DIR",
                   help="directory for trace.json and summary.json (default ./rooflm-profile)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the requests (0: greedy)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the run (default: torch's own choice)")
    p.add_argument("--gpu", default="auto", choices=["auto"] + gpu_choices,
                   help="peaks for MBU/MFU on CUDA: auto matches the device name to the table")
    add_engine_args(p)
    # MoE load imbalance is part of the profile (one index_add per MoE layer and step, in the
    # graphs); --no-count-expert-load profiles the step without it.
    p.set_defaults(func=_run_profile, count_expert_load=True)


def _run_profile(args: argparse.Namespace) -> int:
    from rooflm.perf.profile import run_profile

    return run_profile(args)


def resolve_model_config(model: Optional[str]) -> ModelConfig:
    """A preset name, or a path to an HF directory / .gguf file read by the model loader;
    None: the embedded default model."""
    return resolve_model(model).config


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # for the report: the --model given, or the default model's file name
    config: ModelConfig
    gguf_path: Optional[str]  # the .gguf file read, None for a preset or an HF directory


def resolve_model(model: Optional[str]) -> ResolvedModel:
    from rooflm.model.presets import PRESETS, get_preset

    if model is not None:
        if model.lower() in PRESETS:
            return ResolvedModel(model, get_preset(model), None)
        from rooflm.model import hub
        hub_model = None if os.path.exists(model) else hub.parse(model)
        if hub_model is not None:  # a shape needs the config only: "dummy" downloads no weights
            from rooflm.model import loader
            path, fmt = hub.resolve(hub_model, "auto" if hub_model.gguf_file else "dummy")
            return ResolvedModel(model, loader.load_model_config(path, fmt), path if fmt == "gguf" else None)
        if not os.path.exists(model):
            if os.sep in model or model.lower().endswith(".gguf"):
                raise ValueError(f"{model}: no such file or directory")
            # Let the preset lookup say which names exist.
            return ResolvedModel(model, get_preset(model), None)
    # The loader is imported here: it pulls in safetensors/gguf readers that
    # the calculators do not otherwise need.
    from rooflm.model import loader

    path, fmt = model, "gguf" if model is not None and model.endswith(".gguf") else "safetensors"
    resolve = getattr(loader, "resolve_model", None)
    if resolve is not None:
        resolved = resolve(model, "auto")
        if isinstance(resolved, tuple) and len(resolved) >= 2:
            path, fmt = resolved[0], resolved[1]
    name = model if model is not None else os.path.basename(path)
    return ResolvedModel(name, loader.load_model_config(path, fmt), path if fmt == "gguf" else None)


def default_weight_format(model: ResolvedModel, on_cpu: bool = False) -> str:
    """--dtype's default: what the engine multiplies. A GGUF file's blocks stay blocks where a
    kernel takes them (WEIGHT_FORMATS has those), so its layers' main format is the answer; any
    other GGUF format is dequantized at load, and everything else runs in the engine's dtype:
    bf16 on a GPU, fp32 on a CPU."""
    floating = "fp32" if on_cpu else "bf16"
    if model.gguf_path is None:
        return floating
    from rooflm.model.gguf_loader import layer_weight_types

    counts = layer_weight_types(model.gguf_path)
    main = max(counts, key=counts.get).lower() if counts else ""
    return main if main in WEIGHT_FORMATS else floating


# GGML tensor types -> bytes a weight, for the embedding table (gathered, and read whole as a
# tied LM head). The block formats are WEIGHT_FORMATS'.
_GGML_FLOAT_BYTES = {"F32": 4.0, "F16": 2.0, "BF16": 2.0}


def gguf_embedding_bytes(gguf_path: str) -> Optional[float]:
    """Bytes per weight of a GGUF file's token embedding as stored (the default model's is Q8_0:
    34 bytes a block of 32), or None for a type the table lacks. The CPU engine keeps a tied LM
    head in those blocks (rooflm/quant/linear_method.py), so a CPU step reads it at that size."""
    from rooflm.model.gguf_loader import tensor_type

    kind = tensor_type(gguf_path, "token_embd.weight")
    if kind is None:
        return None
    fmt = WEIGHT_FORMATS.get(kind.lower())
    return fmt.bytes_per_param if fmt is not None else _GGML_FLOAT_BYTES.get(kind)


# The analytic dtypes, and the engine's --kv-cache-dtype spellings (auto, fp8_e4m3) beside them.
KV_DTYPE_CHOICES = ("auto", *sorted(KV_CACHE_BYTES), "fp8_e4m3")


def _default_kv_dtype(weight_dtype: str, kv_dtype: Optional[str], on_cpu: bool = False) -> str:
    if kv_dtype == "fp8_e4m3":
        return "fp8"
    if kv_dtype not in (None, "auto"):
        return kv_dtype
    # "auto" stores the model's dtype: fp32 on a CPU whatever the weights' format.
    return "fp32" if on_cpu or weight_dtype == "fp32" else "bf16"


def run_roofline(args: argparse.Namespace, out: TextIO = None) -> int:
    out = out or sys.stdout
    try:
        model = resolve_model(args.model)
        config = model.config
        gpu = get_gpu(args.gpu)
        dtype = args.dtype or default_weight_format(model, gpu.is_cpu)
        kv_dtype = _default_kv_dtype(dtype, args.kv_dtype, gpu.is_cpu)
        if gpu.is_cpu and args.tp > 1:
            raise ValueError("tensor parallelism is for GPUs: a CPU roofline takes -tp 1")
        latency = None if args.allreduce_latency_us is None else args.allreduce_latency_us * 1e-6
        precision = engine_precision(dtype, gpu.is_cpu)
        head_bytes = None
        if gpu.is_cpu and model.gguf_path is not None and not args.dtype:
            head_bytes = gguf_embedding_bytes(model.gguf_path)
        step = phase_step_cost(config, args.phase, args.batch_size, args.context,
                               weight_dtype=dtype, kv_dtype=kv_dtype, tp=args.tp,
                               allreduce_latency_s=latency, precision=precision, head_bytes=head_bytes)
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        print(f"rooflm roofline: error: {exc}", file=sys.stderr)
        return 2
    out.write(format_roofline(step, gpu, model.name, config, args.phase, args.batch_size,
                              args.context, dtype, kv_dtype, args.tp, precision.note))
    if args.plot:
        from rooflm.perf.plot import plot_roofline

        title = (f"{model.name} {args.phase}, batch {args.batch_size}, context {args.context}, "
                 f"{dtype}" + (f", TP {args.tp}" if args.tp > 1 else "") + f" on {gpu.name}")
        plot_roofline(roofline(step, gpu), gpu, args.plot, title=title,
                      compute_dtype=step.compute_dtype)
        out.write(f"roofline chart written to {args.plot}\n")
    return 0


def format_roofline(step, gpu: GpuSpec, model_name: str, config: ModelConfig, phase: str,
                    batch_size: int, context: int, weight_dtype: str, kv_dtype: str,
                    tp: int, precision_note: Optional[str] = None) -> str:
    rows = roofline(step, gpu)
    summary = summarize(step, gpu)
    fmt = WEIGHT_FORMATS[weight_dtype]
    lines = []
    tp_note = f", TP {tp} (per-GPU figures)" if tp > 1 else ""
    active = f" ({config.num_active_params() / 1e9:.2f}B active per token)" if config.num_experts else ""
    lines.append(f"{model_name}: {config.num_params() / 1e9:.2f}B params{active}, {phase}, batch {batch_size}, "
                 f"context {context}, weights {weight_dtype} ({precision_note or fmt.note}), KV {kv_dtype}{tp_note}")
    if gpu.is_cpu:
        roof = layer_roof(step, gpu)
        lines.append(f"{gpu.name} [{gpu.source}]: {gpu.peak_flops(roof) / 1e9:,.1f} GFLOP/s "
                     f"{gpu.compute_roof_name(roof)}, {gpu.peak_flops('fp32') / 1e9:,.1f} GFLOP/s "
                     f"{gpu.vector_roof_name}, {gpu.memory_name} {gpu.mem_bw_gbs:,.1f} GB/s")
    else:
        lines.append(f"{gpu.name} [{gpu.source}]: {gpu.peak_flops(step.compute_dtype) / 1e12:,.0f} "
                     f"TFLOP/s {step.compute_dtype} dense, {gpu.peak_flops('fp32') / 1e12:,.1f} TFLOP/s "
                     f"{gpu.vector_roof_name}, {gpu.memory_name} {gpu.mem_bw_gbs:,.0f} GB/s")
    lines.append("")
    header = f"{'op':<16} {'GFLOP':>10} {'MB':>10} {'FLOP/B':>8}  {'bound':<7} {'floor us':>10} {'share':>6}"
    lines.append(header)
    lines.append("-" * len(header))
    for r in rows:
        share = r.floor_s / summary.floor_s if summary.floor_s else 0.0
        intensity = "-" if r.op.kind == "comm" else f"{r.op.intensity:8.1f}"
        lines.append(f"{r.op.name:<16} {r.op.flops / 1e9:>10.2f} {r.op.bytes / MB:>10.1f} "
                     f"{intensity:>8}  {r.bound:<7} {r.floor_s * 1e6:>10.1f} {share:>6.1%}")
    lines.append("-" * len(header))
    total_intensity = step.flops / step.bytes if step.bytes else 0.0
    lines.append(f"{'total':<16} {step.flops / 1e9:>10.2f} {step.bytes / MB:>10.1f} "
                 f"{total_intensity:>8.1f}  {'':<7} {summary.floor_s * 1e6:>10.1f} {1:>6.1%}")
    lines.append("")
    all_weights = weight_bytes(config, weight_dtype, tp)
    unread = ""
    if all_weights - summary.weight_bytes > 0.05 * all_weights:
        unread = (f" (of {all_weights / GB:.2f} GB held: the embedding table is gathered row by "
                  f"row, not streamed)")
        if config.num_experts:
            unread = (f" (of {all_weights / GB:.2f} GB held: only the experts the batch routes to are read, "
                      f"~{expected_active_experts(step.num_tokens, config.num_experts, config.num_experts_per_tok):.1f} "
                      f"of {config.num_experts} a layer, and the embedding table is gathered row by row)")
    lines.append(f"bytes per step: {step.bytes / GB:.2f} GB = weights {summary.weight_bytes / GB:.2f} GB"
                 f"{unread} + KV cache {summary.kv_bytes / GB:.3f} GB + activations "
                 f"{summary.other_bytes / GB:.3f} GB; FLOPs per step: {step.flops / 1e9:,.1f} GFLOP")
    if phase == "decode":
        per_what = f"{step.num_tokens} sequence{'s' if step.num_tokens != 1 else ''} x 1 token per step"
        rate = f"{summary.tokens_per_s:,.0f} output tokens/s"
        if step.num_tokens > 1:
            rate += f" ({summary.tokens_per_s / step.num_tokens:,.1f} per sequence)"
    else:
        per_what = f"{batch_size} x {context} prompt tokens per step"
        rate = f"{summary.tokens_per_s:,.0f} prompt tokens/s (TTFT floor {summary.floor_s * 1e3:.2f} ms)"
    lines.append(f"step floor {summary.floor_s * 1e3:.3f} ms -> at most {rate}  [{per_what}]")
    if tp > 1:
        lines.append(_tp_line(step, gpu, config))
    lines.append(f"ridge point of {gpu.key}: {gpu.ridge_point(layer_roof(step, gpu)):.0f} FLOP/B "
                 f"({gpu.compute_roof_name(layer_roof(step, gpu))}), {gpu.ridge_point('fp32'):.0f} FLOP/B "
                 f"({gpu.vector_roof_name}); this step's linear layers: {summary.matmul_intensity:.1f} FLOP/B")
    lines.append("")
    lines.extend(_wrap(verdict(step, gpu, phase, fmt.bytes_per_param), 100))
    return "\n".join(lines) + "\n"


def _tp_line(step, gpu: GpuSpec, config: ModelConfig) -> str:
    """What tensor parallelism adds to a step: its collectives, by size and by count."""
    comm = next(op for op in step.ops if op.name == "tp all-reduce")
    link_s = comm.bytes / (gpu.interconnect_gbs * 1e9)
    messages = 2 * config.num_hidden_layers + 1 + (1 if step.num_sampled else 0)
    return (f"tensor parallel: {messages} collectives per step (2 all-reduces per layer of "
            f"{step.num_tokens} x {config.hidden_size}, the embedding's, the logits' all-gather): "
            f"{comm.bytes / MB:.2f} MB sent per GPU = {link_s * 1e6:.1f} us at "
            f"{gpu.interconnect_gbs:g} GB/s + {comm.latency_s * 1e6:.0f} us of latency "
            f"({comm.latency_s / messages * 1e6:.1f} us each)")


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width)


def run_memory(args: argparse.Namespace, out: TextIO = None) -> int:
    out = out or sys.stdout
    try:
        model = resolve_model(args.model)
        if args.train:
            text = _format_training(args, model.name, model.config, args.dtype or "bf16")
        else:
            text = _format_inference(args, model.name, model.config, args.dtype or default_weight_format(model))
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        print(f"rooflm memory: error: {exc}", file=sys.stderr)
        return 2
    out.write(text)
    return 0


def _host_tier_line(args: argparse.Namespace, plan, config: ModelConfig) -> str:
    """The prefix cache's host tier in the engine's blocks (engine/host_kv_tier.py): blocks of a
    KV cache group's layers where sliding-window layers hold only their window."""
    gib = args.kv_offload_gb
    if gib is None:
        gib, source = KV_OFFLOAD_AUTO_MAX_GB, f"unset: at most {KV_OFFLOAD_AUTO_MAX_GB:g} GiB per GPU"
    else:
        source = f"--kv-offload-gb {gib:g}"
    block_bytes = plan.block_bytes
    per_seq = plan.blocks_per_seq
    if plan.kv_layout.hybrid:
        block_bytes *= plan.kv_layout.group_size / config.num_hidden_layers
        per_seq = plan.hybrid_blocks_per_seq
    blocks = int(gib * 2**30 // block_bytes) if block_bytes > 0 else 0
    return (f"prefix cache host tier ({source}): {blocks:,} blocks, {blocks * plan.block_size:,} tokens "
            f"({blocks / max(per_seq, 1):,.1f} sequences at {plan.context} tokens), pinned host memory")


def _format_inference(args: argparse.Namespace, name: str, config: ModelConfig, dtype: str) -> str:
    kv_dtype = _default_kv_dtype(dtype, args.kv_dtype)
    context = args.context or min(config.max_position_embeddings, 8192)
    gpu_mem = args.gpu_mem if args.gpu_mem is not None else (
        get_gpu(args.gpu).mem_gb if args.gpu else 80.0)
    plan = inference_memory(config, weight_dtype=dtype, kv_dtype=kv_dtype, context=context,
                            gpu_mem_gb=gpu_mem, tp=args.tp, block_size=args.block_size,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs, pp=args.pp)
    kv_elem = KV_CACHE_BYTES[kv_dtype]
    kv_heads_local = kv_bytes_per_token_per_gpu(config, 1, args.tp) / (2 * config.num_hidden_layers
                                                                      * config.head_dim)
    tp_note = f" per GPU of TP {args.tp}" if args.tp > 1 else ""
    kv_layers = config.num_hidden_layers
    if args.pp > 1:
        least = min(plan.stages, key=lambda st: st.num_blocks)
        tp_note += f", PP {args.pp}: stage {least.stage}'s GPU (the fewest KV blocks)"
        kv_layers = least.layers[1] - least.layers[0]
    lines = [
        f"{name}: {plan.num_params / 1e9:.2f}B params, weights {dtype} ({WEIGHT_FORMATS[dtype].note}), KV {kv_dtype}"
        f"{tp_note}, {gpu_mem:g} GB GPU x {args.gpu_memory_utilization:g} utilization",
        "",
        f"{'weights':<34} {plan.weights / GB:>10.2f} GB",
        f"{'activation reserve (estimate)':<34} {plan.activation_reserve / GB:>10.2f} GB"
        f"   ({args.max_num_batched_tokens} batched tokens, {plan.max_num_seqs} seqs of logits)",
        f"{'KV cache pool':<34} {plan.kv_pool / GB:>10.2f} GB"
        f"   (= {plan.usable / GB:.2f} usable - weights - reserve)",
        "",
        f"KV bytes per token: 2 x {kv_layers} layers x {kv_heads_local:g} KV heads x "
        f"{config.head_dim} head dim x {kv_elem:g} B = {plan.kv_bytes_per_token / 1e3:,.1f} kB"
        + (f" (GQA: {config.num_attention_heads // config.num_key_value_heads} query heads share "
           f"each KV head)" if config.num_key_value_heads < config.num_attention_heads else ""),
        f"KV bytes per sequence at {context} tokens: {plan.kv_bytes_per_seq / GB:.2f} GB",
        f"blocks of {plan.block_size} tokens: {plan.block_bytes / MB:.2f} MB each, "
        f"{plan.num_blocks:,} fit ({plan.max_cached_tokens:,} tokens)",
        f"concurrent sequences at {context} tokens: {plan.max_concurrent_seqs:,} "
        f"({plan.blocks_per_seq} blocks each)" + (" with a full-history cache (--disable-hybrid-kv-cache-manager)"
                                                  if plan.kv_layout.hybrid else ""),
    ]
    layout = plan.kv_layout
    if layout.hybrid:
        groups = ", ".join("full" if w is None else f"window {w}" for w in layout.windows)
        ratio = plan.hybrid_concurrent_seqs / max(plan.max_concurrent_seqs, 1)
        lines.append(
            f"concurrent sequences at {context} tokens: {plan.hybrid_concurrent_seqs:,} with sliding-window "
            f"layers holding only their window ({ratio:.1f}x; {plan.hybrid_num_blocks:,} blocks of "
            f"{layout.group_size} layers, {plan.hybrid_blocks_per_seq} each over groups {groups})")
    for st in plan.stages:
        lines.append(f"pipeline stage {st.stage}: layers {st.layers[0]}-{st.layers[1] - 1}"
                     f"{' + embedding + LM head' if st.stage == 0 else ''}"
                     f"{' + final norm' if st.stage == len(plan.stages) - 1 else ''}: weights "
                     f"{st.weights / GB:.2f} GB, KV pool {st.kv_pool / GB:.2f} GB, blocks of {st.block_bytes / MB:.2f} MB, "
                     f"{st.num_blocks:,} fit")
    lines.append(_host_tier_line(args, plan, config))
    if plan.kv_pool <= 0:
        lines.append("the weights and reserve do not fit: no room for a KV cache (try -tp or a "
                     "smaller --dtype)")
    return "\n".join(lines) + "\n"


def _format_training(args: argparse.Namespace, name: str, config: ModelConfig, dtype: str) -> str:
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError("--train supports --dtype bf16, fp16 or fp32")
    seq_len = args.context or 2048
    n_gpus = args.num_gpus
    mem = training_memory(config, num_gpus=n_gpus, micro_batch=args.batch_size, seq_len=seq_len,
                          dtype=dtype, flash_attention=not args.no_flash_attention)
    n = mem.num_params

    def row(label: str, total: float, ddp: Optional[float], fsdp: Optional[float]) -> str:
        per_param = f"{total / n:>6.1f} B" if ddp is not None else " " * 8
        ddp_text = f"{ddp / GB:>12.2f}" if ddp is not None else f"{'':>12}"
        fsdp_text = f"{fsdp / GB:>12.2f}" if fsdp is not None else f"{'':>12}"
        return f"{label:<36} {per_param} {total / GB:>12.2f} {ddp_text} {fsdp_text}"

    attention = "eager attention" if args.no_flash_attention else "FlashAttention"
    lines = [
        f"{name}: {n / 1e9:.2f}B params, Adam, {dtype} "
        f"{'mixed precision' if dtype != 'fp32' else ''}, micro-batch {args.batch_size} x "
        f"{seq_len} tokens per GPU, {attention}",
        "",
        f"{'':<36} {'per param':>8} {'model (GB)':>12} {'DDP/GPU':>12} {'FSDP/GPU':>12}",
        f"{'':<36} {'':>8} {'':>12} {'(GB)':>12} {'(GB, N=' + str(n_gpus) + ')':>12}",
    ]
    shard = n_gpus
    lines.append(row(f"weights ({dtype})", mem.weights, mem.weights, mem.weights / shard))
    lines.append(row(f"gradients ({dtype})", mem.gradients, mem.gradients, mem.gradients / shard))
    if mem.master_weights:
        lines.append(row("fp32 master weights", mem.master_weights, mem.master_weights,
                         mem.master_weights / shard))
    lines.append(row("Adam moments (fp32 m and v)", mem.adam_moments, mem.adam_moments,
                     mem.adam_moments / shard))
    lines.append(row("states, before activations", mem.states, mem.states, mem.states / shard))
    lines.append(row("FSDP gathered unit (transient)", mem.fsdp_gathered, None, mem.fsdp_gathered))
    lines.append("")
    lines.append(f"{'activations, no checkpointing':<36} {'':>8} {mem.activations / GB:>12.2f}")
    lines.append(f"{'activations, full checkpointing':<36} {'':>8} "
                 f"{mem.activations_checkpointed / GB:>12.2f}")
    lines.append(f"{'activations, selective checkpointing':<36} {'':>8} "
                 f"{mem.activations_selective / GB:>12.2f}")
    lines.append("")
    lines.append(f"{'total per GPU, no checkpointing':<36} {'':>8} {'':>12} "
                 f"{mem.ddp_per_gpu(False) / GB:>12.2f} {mem.fsdp_per_gpu(False) / GB:>12.2f}")
    lines.append(f"{'total per GPU, full checkpointing':<36} {'':>8} {'':>12} "
                 f"{mem.ddp_per_gpu(True) / GB:>12.2f} {mem.fsdp_per_gpu(True) / GB:>12.2f}")
    lines.append(f"{'total per GPU, selective':<36} {'':>8} {'':>12} "
                 f"{mem.ddp_per_gpu('selective') / GB:>12.2f} {mem.fsdp_per_gpu('selective') / GB:>12.2f}")
    lines.append("")
    lines.append(
        f"{mem.state_bytes_per_param:g} bytes per parameter before activations "
        + ("(2 weight + 2 gradient + 4 fp32 master + 8 Adam); " if dtype != "fp32"
           else "(4 weight + 4 gradient + 8 Adam); ")
        + "DDP replicates them on every GPU, FSDP divides them by N.")
    return "\n".join(lines) + "\n"
