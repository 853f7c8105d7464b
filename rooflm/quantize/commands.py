"""`rooflm quantize`: offline weight-only quantization to a GPTQ-layout HF directory (quantize.py)."""

from __future__ import annotations

import argparse
import time

from rooflm.tokenizer.text_windows import CALIB_SKIP_WINDOWS, CALIB_WINDOWS, WINDOW

# rooflm.quantize.gptq.DEFAULT_DAMP, repeated so that building the CLI imports no torch
GPTQ_DAMP = 0.01
GPTQ_V2_ALPHA = 0.25

_FLOAT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model's linear weights (RTN, GPTQ, AWQ) into a GPTQ-layout HF directory")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--scheme", default="int4-g128",
                   help="int8 (per channel) | int4-g32 | int4-g64 | int4-g128 (GPTQ layout) | fp8 (compressed-tensors "
                        "W8A8: per-channel e4m3 weights, dynamic per-token activations)")
    p.add_argument("--method", default=None, choices=("rtn", "gptq", "awq", "awq+gptq"),
                   help="rtn: round to nearest; gptq: error compensation from calibration inputs; "
                        "awq: activation-aware per-channel scales (folded into the norms) then RTN with a "
                        "clipped range; awq+gptq: AWQ scales then GPTQ (default gptq; fp8: rtn, the only one)")
    p.add_argument("--calib-text", default=None, help="calibration text (default: pydoc_data/topics.py)")
    p.add_argument("--calib-windows", type=int, default=CALIB_WINDOWS, help="calibration windows (GPTQ, AWQ)")
    p.add_argument("--no-clip", action="store_true", help="AWQ: skip the weight-range (clip) search")
    p.add_argument("--awq-score", default=None, choices=("rtn", "gptq"),
                   help="AWQ: quantizer used to score each alpha: rtn (llm-awq's; the default of --method awq) or "
                        "gptq (the one awq+gptq writes, with its --act-order/--mse; the default of awq+gptq: "
                        "+5.37%% vs +7.67%% perplexity on SmolLM2 g128, but +3.85%% vs +3.13%% at g32)")
    p.add_argument("--awq-objective", default="linear", choices=("linear", "block"),
                   help="AWQ: what each alpha is scored by: linear (each linear's own output error on the calibration "
                        "Hessian) or block (llm-awq's: the attention block's output for qkv_proj, the MLP's for "
                        "gate_up_proj, with o_proj / down_proj quantized as written; awq_block.py). On SmolLM2 g128 "
                        "awq+gptq: +6.31%% perplexity vs +5.37%%, though KL 0.042 vs 0.044 nats")
    p.add_argument("--awq-block-windows", type=int, default=4,
                   help="AWQ --awq-objective block: calibration windows the blocks are run on (the first ones)")
    p.add_argument("--awq-inputs", default="float", choices=("float", "quantized"),
                   help="AWQ+GPTQ with --awq-objective block: search each layer's scales on the float model's "
                        "inputs, or on those the already scaled and quantized layers before it produce "
                        "(awq_sequential.py; GPTQ then runs sequentially too). SmolLM2 g128: +6.77%%, KL 0.040")
    p.add_argument("--duo", action="store_true",
                   help="AWQ: also search AutoAWQ's scales mean|x|^alpha / mean|w|^(1-alpha) beside mean|x|^alpha")
    p.add_argument("--calib-window", type=int, default=WINDOW, help="tokens per calibration window")
    p.add_argument("--calib-skip-windows", type=int, default=CALIB_SKIP_WINDOWS,
                   help="windows skipped at the start of the text (`eval ppl` scores the first 16 by default and "
                        f"refuses ranges that overlap windows {CALIB_SKIP_WINDOWS}..{CALIB_SKIP_WINDOWS + CALIB_WINDOWS - 1} "
                        f"of {WINDOW} tokens, these defaults' calibration: it must not see scored text)")
    p.add_argument("--act-order", action="store_true",
                   help="GPTQ: quantize inputs by decreasing Hessian diagonal (desc_act, g_idx in the checkpoint)")
    p.add_argument("--mse", action="store_true",
                   help="GPTQ: search each group's range for the least Hessian-weighted rounding error")
    p.add_argument("--mse-skip-qk", action="store_true",
                   help="GPTQ --mse: keep the q and k rows' full min..max range (AWQ's clip search skips q/k: their "
                        "errors reach the attention scores). SmolLM2 g128 awq+gptq: +5.02%% vs +5.37%%, within noise")
    p.add_argument("--refit", action="store_true",
                   help="GPTQ (4-bit): after the codes are found, refit each row's group scales to the least output "
                        "error on the calibration Hessian (gptq.refit_group_scales); AWQ's GPTQ scoring uses it too. "
                        "SmolLM2 g128 awq+gptq: +5.52%% vs +5.37%%")
    p.add_argument("--damp", type=float, default=GPTQ_DAMP,
                   help="GPTQ / AWQ+GPTQ: damping added to the Hessian's diagonal before it is inverted, as a "
                        "fraction of its mean diagonal (GPTQ's percdamp, AutoGPTQ's damp_percent; written to "
                        "config.json). Larger: less error pushed onto weakly seen inputs, closer to RTN. "
                        "AWQ's GPTQ scoring uses it too")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ / AWQ+GPTQ: calibrate each linear on the outputs of the already quantized linears "
                        "before it (true-sequential, sequential.py) instead of the float model's; default on for "
                        "gptq (+7.2%% vs +8.4%% perplexity on SmolLM2 g128), off for awq+gptq (g128 +5.46%% vs +5.37%%, g32 +4.87%% vs +3.85%%)")
    p.add_argument("--gptq-v2", action="store_true",
                   help="GPTQ / AWQ+GPTQ: GPTQv2's asymmetric calibration (GPTQModel's v2=True): each linear is "
                        "fitted to the float model's outputs on the float model's inputs while fed the quantized "
                        "predecessors' (gptq.asymmetric_target); implies --sequential and one more calibration "
                        "prefill whose inputs are held in memory (~6.4 GB for SmolLM2 at 32 windows)")
    p.add_argument("--gptq-v2-alpha", type=float, default=GPTQ_V2_ALPHA,
                   help="--gptq-v2: how much of the asymmetric correction to apply, 0..1 (0 is plain sequential "
                        "GPTQ; GPTQv2's and GPTQModel's default 0.25)")
    p.add_argument("--kv-cache-scales", action="store_true",
                   help="--scheme fp8: also calibrate static FP8 K/V scales on the calibration windows (one "
                        "per layer for K after RoPE and one for V: max |x| / 448) and write them as "
                        "compressed-tensors' kv_cache_scheme; `--kv-cache-dtype fp8` then uses them (kv_scales.py)")
    p.add_argument("--float-dtype", default="bfloat16", choices=tuple(_FLOAT_DTYPES),
                   help="dtype of the tensors kept in float: embeddings, LM head, norms")
    p.set_defaults(func=run_quantize)


def use_sequential(method: str, flag) -> bool:
    """Whether GPTQ calibrates on the quantized predecessors' outputs (sequential.py); flag is
    --sequential / --no-sequential / None (not given)."""
    if method not in ("gptq", "awq+gptq"):
        if flag:
            raise ValueError(f"--sequential applies to --method gptq and awq+gptq (the GPTQ pass); got {method}")
        return False
    # Sequential by default only where it measured better (benchmarks/results/quant-cpu-20261125/):
    # GPTQ alone; after AWQ (whose scales come from the float model) it was no better at g128 and
    # a point worse at g32.
    return flag if flag is not None else method == "gptq"


def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from rooflm.tokenizer.text_windows import read_text, token_windows
    from rooflm.llm import LLM
    from rooflm.model.hf_config import hf_config_dict
    from rooflm.quantize.quantize import collect_hessians, quantized_state_dict, write_checkpoint
    from rooflm.quant.rtn import WeightScheme

    float_dtype = getattr(torch, args.float_dtype)
    if args.scheme == "fp8":
        return _quantize_fp8(args, float_dtype)
    if args.kv_cache_scales:
        raise ValueError("--kv-cache-scales writes compressed-tensors' kv_cache_scheme: it goes with --scheme fp8")
    scheme = WeightScheme.parse(args.scheme)
    args.method = args.method or "gptq"
    t0 = time.perf_counter()
    sequential = use_sequential(args.method, args.sequential)
    if args.mse_skip_qk and not args.mse:
        raise ValueError("--mse-skip-qk narrows GPTQ's --mse range search: give --mse too")
    if not 0 < args.damp < 1:
        raise ValueError(f"--damp is a fraction of the Hessian's mean diagonal: 0 < damp < 1, got {args.damp}")
    if args.damp != GPTQ_DAMP and args.method not in ("gptq", "awq+gptq"):
        raise ValueError(f"--damp sets GPTQ's damping: it applies to --method gptq and awq+gptq, not {args.method}")
    if args.refit and args.method not in ("gptq", "awq+gptq"):
        raise ValueError(f"--refit refits GPTQ's scales: it applies to --method gptq and awq+gptq, not {args.method}")
    if args.gptq_v2:
        if args.method not in ("gptq", "awq+gptq"):
            raise ValueError(f"--gptq-v2 changes GPTQ's calibration: it applies to --method gptq and awq+gptq, "
                             f"not {args.method}")
        if args.awq_inputs == "quantized":
            raise ValueError("--gptq-v2 is not implemented for --awq-inputs quantized (awq_sequential.py's own pass)")
        if args.sequential is False:
            raise ValueError("--gptq-v2 calibrates on the quantized predecessors' inputs: it cannot be --no-sequential")
        if not 0 <= args.gptq_v2_alpha <= 1:
            raise ValueError(f"--gptq-v2-alpha is a fraction of the asymmetric correction: 0..1, "
                             f"got {args.gptq_v2_alpha}")
        sequential = True
    elif args.gptq_v2_alpha != GPTQ_V2_ALPHA:
        raise ValueError("--gptq-v2-alpha sets --gptq-v2's correction: give --gptq-v2 too")
    awq_on_quantized = args.awq_inputs == "quantized"
    if awq_on_quantized:
        if args.method != "awq+gptq" or args.awq_objective != "block":
            raise ValueError("--awq-inputs quantized needs --method awq+gptq --awq-objective block")
        if args.sequential is False:
            raise ValueError("--awq-inputs quantized quantizes layer by layer: it cannot be --no-sequential")
        sequential = True
    extra = {}
    calib_tokens = args.calib_windows * args.calib_window
    if sequential:  # the sequential pass needs every calibration token in one prefill step
        extra["max_num_batched_tokens"] = max(2048, calib_tokens)
    llm = LLM(model=args.model, device="cpu", dtype="float32", quantization="none", enable_prefix_caching=False,
              **extra)
    info = llm.engine.info
    slots = calib_tokens + args.calib_windows * info.block_size  # each window's last block partly empty
    if sequential and (info.kv_capacity_tokens < slots or info.max_num_seqs < args.calib_windows):
        # ... so also every window as a sequence of the step and all their KV at once: the
        # default pool (cpu_kv_cache_gb) holds ~23k SmolLM2 tokens in fp32. Rebuilt once.
        from rooflm.quantize.sequential import kv_cache_gb_for
        extra["cpu_kv_cache_gb"] = max(1.0, kv_cache_gb_for(info, slots))
        extra["max_num_seqs"] = max(info.max_num_seqs, args.calib_windows)
        llm.shutdown()
        llm = LLM(model=args.model, device="cpu", dtype="float32", quantization="none", enable_prefix_caching=False,
                  **extra)
    model = llm.engine.model
    hessians = None
    calib = ""
    awq_note = ""
    if args.method != "rtn":
        if llm.tokenizer is None:
            raise ValueError(f"{args.method} calibration needs a tokenizer")
        text, path = read_text(args.calib_text)
        ids = llm.tokenizer.encode(text)
        windows = token_windows(ids, args.calib_window, args.calib_skip_windows + args.calib_windows)
        windows = windows[args.calib_skip_windows:]
        if not windows:
            raise ValueError(f"the calibration text has no windows left after skipping {args.calib_skip_windows}")
        act_means: dict = {}
        # Sequential GPTQ collects its own Hessians; only AWQ's scale search needs the float pass.
        if not (sequential and args.method == "gptq"):
            hessians = collect_hessians(llm, windows, act_means)
        calib = f" Calibration: {len(windows)} windows of {args.calib_window} tokens of {path}, after skipping {args.calib_skip_windows}."
        print(f"calibration: {len(windows) * args.calib_window} tokens in {time.perf_counter() - t0:.1f} s")
    if args.method.startswith("awq") and not awq_on_quantized:
        from rooflm.quantize.awq import AwqConfig, apply_awq
        args.awq_score = args.awq_score or ("gptq" if args.method == "awq+gptq" else "rtn")
        t1 = time.perf_counter()
        config = AwqConfig(scheme, duo_scaling=args.duo, score_with=args.awq_score,
                           gptq_act_order=args.act_order, gptq_mse=args.mse, gptq_refit=args.refit,
                           gptq_mse_skip_qk=args.mse_skip_qk, gptq_damp=args.damp)
        # GPTQ scoring is GPTQ's column loop many times over: one thread (see below).
        threads = torch.get_num_threads()
        if args.awq_score == "gptq":
            torch.set_num_threads(1)
        try:
            if args.awq_objective == "block":
                from rooflm.quantize.awq_block import apply_awq_block, capture_block_inputs
                if args.awq_block_windows < 1:
                    raise ValueError(f"--awq-block-windows must be >= 1, got {args.awq_block_windows}")
                inputs = capture_block_inputs(llm, windows[:args.awq_block_windows])
                report = apply_awq_block(model, hessians, act_means, inputs, config)
                del inputs
            else:
                report = apply_awq(model, hessians, act_means, config)
        finally:
            torch.set_num_threads(threads)
        awq_note = " " + report.summary() + "."
        print(f"{report.summary()} ({time.perf_counter() - t1:.1f} s)")
    # AWQ without the clip search writes the scaled weights rounded to nearest.
    method = "rtn" if args.method == "awq" and args.no_clip else args.method
    # GPTQ's column loop is thousands of tiny ops per layer: intra-op threads only add barriers
    # (a 3072 x 576 weight took 1.9 s on one thread of the loaded 2-core box; the two-thread run
    # of all 120 SmolLM2 linears took ~20 min there).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    prequantized = None
    try:
        if awq_on_quantized:
            from rooflm.quantize.awq import AwqConfig
            from rooflm.quantize.awq_sequential import sequential_awq_gptq
            args.awq_score = args.awq_score or "gptq"
            t2 = time.perf_counter()
            config = AwqConfig(scheme, duo_scaling=args.duo, score_with=args.awq_score,
                               gptq_act_order=args.act_order, gptq_mse=args.mse, gptq_refit=args.refit,
                               gptq_mse_skip_qk=args.mse_skip_qk, gptq_damp=args.damp)
            prequantized, report = sequential_awq_gptq(llm, windows, config, hessians, act_means,
                                                       args.awq_block_windows, args.act_order, args.mse, args.refit)
            awq_note = " " + report.summary() + "."
            print(f"{report.summary()}; sequential AWQ+GPTQ: {len(prequantized)} linears in "
                  f"{time.perf_counter() - t2:.1f} s")
        elif sequential:
            from rooflm.quantize.sequential import sequential_gptq
            t2 = time.perf_counter()
            prequantized = sequential_gptq(llm, windows, scheme, args.act_order, args.mse, refit=args.refit,
                                           mse_skip_qk=args.mse_skip_qk, damp=args.damp,
                                           v2_alpha=args.gptq_v2_alpha if args.gptq_v2 else None)
            print(f"sequential GPTQ{'v2' if args.gptq_v2 else ''}: {len(prequantized)} linears in {time.perf_counter() - t2:.1f} s")
        tensors = quantized_state_dict(model, scheme, method, hessians, float_dtype, args.act_order, args.mse,
                                       prequantized, refit=args.refit, mse_skip_qk=args.mse_skip_qk,
                                       damp=args.damp)
    finally:
        torch.set_num_threads(threads)
    config = hf_config_dict(llm.engine.model_config)
    options = "".join(f" --{o.replace('_', '-')}" for o in ("act_order", "mse", "mse_skip_qk", "refit", "no_clip", "duo") if getattr(args, o))
    if args.method in ("gptq", "awq+gptq"):
        options += " --sequential" if sequential else " --no-sequential"
        if args.damp != GPTQ_DAMP:
            options += f" --damp {args.damp:g}"
        if args.gptq_v2:
            options += f" --gptq-v2 --gptq-v2-alpha {args.gptq_v2_alpha:g}"
    if args.method.startswith("awq"):
        options += f" --awq-score {args.awq_score} --awq-objective {args.awq_objective}"
        if args.awq_objective == "block":
            options += f" --awq-block-windows {args.awq_block_windows} --awq-inputs {args.awq_inputs}"
    note = (f"# {args.scheme} {args.method}{options} of {args.model or 'the embedded SmolLM2-135M-Instruct'}\n\n"
            f"Written by `rooflm quantize` in the GPTQ v1 layout (rooflm/quant/formats.py).{calib}{awq_note} "
            f"Embeddings, LM head and norms in {args.float_dtype}.")
    write_checkpoint(args.output, config, tensors, scheme, float_dtype, llm.tokenizer, note,
                     args.act_order and "gptq" in args.method, sequential=sequential, damp=args.damp)
    print(f"wrote {args.output} ({args.scheme} {args.method}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _quantize_fp8(args: argparse.Namespace, float_dtype) -> int:
    """--scheme fp8: round each decoder linear to per-channel e4m3 (no calibration: activations
    are quantized per token at run time) and write compressed-tensors."""
    from rooflm.llm import LLM
    from rooflm.model.hf_config import hf_config_dict
    from rooflm.quant.fp8 import compressed_tensors_config
    from rooflm.quantize.quantize import fp8_state_dict, write_checkpoint

    if args.method not in (None, "rtn"):
        raise ValueError(f"--scheme fp8 rounds to nearest per channel; --method {args.method} applies to the "
                         f"int8/int4 schemes")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, device="cpu", dtype="float32", quantization="none", enable_prefix_caching=False)
    tensors = fp8_state_dict(llm.engine.model, float_dtype)
    quant_config = compressed_tensors_config()
    kv_note = ""
    if args.kv_cache_scales:
        from rooflm.tokenizer.text_windows import read_text, token_windows
        from rooflm.quantize.kv_scales import KV_CACHE_SCHEME, calibrate_kv_scales, kv_scale_tensors
        if llm.tokenizer is None:
            raise ValueError("--kv-cache-scales calibration needs a tokenizer")
        text, path = read_text(args.calib_text)
        windows = token_windows(llm.tokenizer.encode(text), args.calib_window,
                                args.calib_skip_windows + args.calib_windows)[args.calib_skip_windows:]
        if not windows:
            raise ValueError(f"the calibration text has no windows left after skipping {args.calib_skip_windows}")
        scales = calibrate_kv_scales(llm, windows)
        tensors.update(kv_scale_tensors(scales))
        quant_config["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
        kv_note = (f" Static FP8 K/V scales (kv_cache_scheme, rooflm/quantize/kv_scales.py) from {len(windows)} "
                   f"windows of {args.calib_window} tokens of {path}: K {scales[:, 0].min():.3g}..."
                   f"{scales[:, 0].max():.3g}, V {scales[:, 1].min():.3g}...{scales[:, 1].max():.3g}.")
        print(f"K/V scales calibrated on {len(windows) * args.calib_window} tokens")
    note = (f"# fp8 W8A8 of {args.model or 'the embedded SmolLM2-135M-Instruct'}\n\n"
            f"Written by `rooflm quantize --scheme fp8` in compressed-tensors float-quantized (rooflm/quant/fp8.py): "
            f"per-channel e4m3 weights, dynamic per-token e4m3 activations. Embeddings, LM head and norms in "
            f"{args.float_dtype}.{kv_note}")
    write_checkpoint(args.output, hf_config_dict(llm.engine.model_config), tensors, None, float_dtype,
                     llm.tokenizer, note, quant_config=quant_config)
    print(f"wrote {args.output} (fp8) in {time.perf_counter() - t0:.1f} s")
    return 0
