"""The `rooflm` command: generate | chat | serve | bench | roofline | memory | profile.

Engine flags are generated from the config dataclasses, so a new config field
is a new flag with no extra code.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing

from rooflm import config as cfg


def _flag_type(field: dataclasses.Field):
    hint = str(field.type)
    if "bool" in hint:
        return None
    if "int" in hint:
        return int
    if "float" in hint:
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for section, cls in cfg._SECTIONS.items():
        group = parser.add_argument_group(f"{section} options")
        for field in dataclasses.fields(cls):
            # LoadConfig.seed (dummy weights) would clash with the sampling --seed.
            flag = "--weights-seed" if field.name == "seed" else "--" + field.name.replace("_", "-")
            default = field.default
            if _flag_type(field) is None:
                group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                   default=default, help=f"(default: {default})")
            else:
                group.add_argument(flag, dest=field.name, type=_flag_type(field), default=default,
                                   help=f"(default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for cls in cfg._SECTIONS.values() for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from rooflm.sampling_params import SamplingParams
    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from rooflm.llm import LLM
    params = sampling_params(args)
    llm = LLM(**engine_kwargs(args))
    prompts = list(args.prompt)
    if args.chat_template:
        tok = llm.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                              add_special_tokens=False) for p in prompts]
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(args.prompt, outputs):
        for sample in out.outputs:
            if len(outputs) > 1 or len(out.outputs) > 1:
                print(f"--- {prompt!r} [{sample.index}] ({sample.finish_reason})")
            print(sample.text.strip() if args.chat_template else sample.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from rooflm.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    tok = engine.tokenizer
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    params = sampling_params(args)
    turn = 0
    print("rooflm chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, ids, params)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.delta_text[0] if out.delta_text else ""
                reply += delta
                print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply.strip()})
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("rooflm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rooflm", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--version", action="version", version=f"rooflm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts with the offline engine")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt as a user turn of the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=512)

    _register_optional(sub)
    return parser


def _register_optional(sub) -> None:
    """Subcommands that live with their own subsystem."""
    import importlib
    for module in ("rooflm.perf.commands", "rooflm.server.commands", "rooflm.bench.commands"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("rooflm"):
                continue  # subsystem not present in this build
            raise
        mod.register(sub)


def main(argv: typing.Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"rooflm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
