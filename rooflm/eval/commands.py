"""`rooflm eval ppl` and `rooflm eval drift`: accuracy, measured through the engine that serves."""

from __future__ import annotations

import argparse
import dataclasses
import json

from rooflm.engine_args import add_engine_args, engine_kwargs


def register(sub) -> None:
    from rooflm.tokenizer.text_windows import CALIB_SKIP_WINDOWS, CALIB_WINDOWS, WINDOW

    ev = sub.add_parser("eval", help="perplexity of a model on a text, and drift between two runs")
    eval_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = eval_sub.add_parser("ppl", help="perplexity on a text (default: Python's pydoc_data/topics.py)")
    ppl.add_argument("--text", default=None, help="a UTF-8 text file (default: pydoc_data/topics.py)")
    ppl.add_argument("--window", type=int, default=WINDOW, help="tokens per window (non-overlapping)")
    ppl.add_argument("--max-windows", type=int, default=16,
                     help="score at most this many windows, from --first-window on. On the default text a range "
                          f"that overlaps windows {CALIB_SKIP_WINDOWS}..{CALIB_SKIP_WINDOWS + CALIB_WINDOWS - 1} of "
                          f"{WINDOW} tokens, those `rooflm quantize` calibrates on by default, is refused")
    ppl.add_argument("--first-window", type=int, default=0,
                     help="index of the first window scored (default 0, the start of the text); e.g. "
                          f"--first-window {CALIB_SKIP_WINDOWS + 32} scores past the windows a --calib-windows 32 "
                          "quantize calibrated on")
    ppl.add_argument("--top-k", type=int, default=20, help="top tokens kept per position, for drift")
    ppl.add_argument("--output-json", default=None, help="write the result with every position (for drift)")
    add_engine_args(ppl)
    ppl.set_defaults(func=run_ppl)
    drift = eval_sub.add_parser("drift", help="compare two `eval ppl` results on the same windows")
    drift.add_argument("a", help="the reference run's --output-json")
    drift.add_argument("b", help="the other run's --output-json")
    drift.set_defaults(func=run_drift)


def run_ppl(args: argparse.Namespace) -> int:
    import os

    from rooflm.eval.ppl import perplexity
    from rooflm.tokenizer.text_windows import check_held_out, default_text_path, read_text, token_windows
    from rooflm.llm import LLM

    text, path = read_text(args.text)
    if os.path.realpath(path) == os.path.realpath(default_text_path()):
        check_held_out(args.window, args.max_windows, args.first_window)
    kwargs = engine_kwargs(args)
    # Prefix caching would skip the scored tokens of a repeated window.
    kwargs["enable_prefix_caching"] = False
    llm = LLM(**kwargs)
    if llm.tokenizer is None:
        raise ValueError("eval ppl needs a tokenizer: pass a model directory or GGUF with one, or --tokenizer")
    ids = llm.tokenizer.encode(text)
    windows = token_windows(ids, args.window, args.max_windows, args.first_window)
    engine = {k: v for k, v in kwargs.items() if v is not None}
    result = perplexity(llm, windows, args.top_k, model=str(kwargs.get("model") or "default"), text=path,
                        engine=engine, first_window=args.first_window, progress=True)
    span = "" if args.first_window == 0 else \
        f" ({args.first_window}..{args.first_window + result.num_windows - 1})"
    print(f"perplexity {result.ppl:.4f} (NLL {result.nll:.4f} nats/token) over {result.num_scored} tokens "
          f"in {result.num_windows} windows{span} of {result.window}; text {path}")
    if args.output_json:
        data = result.summary()
        data["positions"] = [dataclasses.asdict(p) for p in result.positions]
        with open(args.output_json, "w") as f:
            json.dump(data, f)
        print(f"result written to {args.output_json}")
    return 0


def run_drift(args: argparse.Namespace) -> int:
    from rooflm.eval.drift import compare

    runs = []
    for path in (args.a, args.b):
        with open(path) as f:
            runs.append(json.load(f))
    d = compare(*runs)
    print(f"positions compared:          {d.num_positions}")
    print(f"perplexity A / B:            {d.ppl_a:.4f} / {d.ppl_b:.4f} ({100 * d.ppl_change:+.2f}%)")
    print(f"top-1 agreement:             {100 * d.top1_agreement:.2f}%")
    print(f"mean |delta logprob|:        {d.mean_abs_logprob_delta:.4f} nats")
    print(f"mean KL(A||B), lower bound:  {d.mean_kl_lower_bound:.5f} nats (top-k tokens + the rest)")
    return 0
