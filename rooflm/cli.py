"""The `rooflm` command: generate | chat | serve | bench | roofline | memory | profile | env.

Entry points only: the engine and sampling flags come from rooflm/engine_args.py, where the
tools that run an engine take them too.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
import time
import typing

import rooflm.envs as envs
from rooflm.engine_args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from rooflm.version import __version__


def cmd_generate(args: argparse.Namespace) -> int:
    from rooflm.llm import LLM
    params = sampling_params(args)
    llm = LLM(**engine_kwargs(args))
    try:
        prompts, labels, templated = _generate_prompts(args, llm)
    except ValueError as exc:
        print(f"rooflm: error: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    outputs = llm.generate(prompts, params)
    elapsed = time.monotonic() - start
    for label, out in zip(labels, outputs):
        for sample in out.outputs:
            if len(outputs) > 1 or len(out.outputs) > 1:
                print(f"--- {label!r} [{sample.index}] ({sample.finish_reason})")
            text = sample.text.strip() if templated else sample.text
            # A model without a tokenizer has no text: its token ids are the output.
            print(text if llm.tokenizer is not None else " ".join(map(str, sample.token_ids)))
    sys.stdout.flush()  # the text first, then the summary under it
    print(generate_summary(outputs, elapsed), file=sys.stderr)
    return 0


def generate_summary(outputs: list, elapsed_s: float) -> str:
    """One line of timings on stderr, as llama.cpp prints its own: tokens in and out, the time to
    the first token (the mean over the prompts) and output tokens/s over the whole call."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    output_tokens = sum(len(s.token_ids) for out in outputs for s in out.outputs)
    ttfts = [out.first_token_time - out.arrival_time for out in outputs
             if out.first_token_time is not None and out.arrival_time is not None]
    ttft = f"{1e3 * sum(ttfts) / len(ttfts):.1f} ms" if ttfts else "-"
    rate = f"{output_tokens / elapsed_s:.1f}" if elapsed_s > 0 else "-"
    prompts = f"{len(outputs)} prompts, " if len(outputs) > 1 else ""
    return (f"rooflm generate: {prompts}{prompt_tokens} prompt tokens, {output_tokens} output tokens, "
            f"TTFT {ttft}, {rate} output tokens/s ({elapsed_s:.2f} s)")


def _generate_prompts(args: argparse.Namespace, llm) -> tuple[list, list[str], bool]:
    """(prompts for the engine, labels to print, whether the chat template wrapped them).

    Text prompts need a tokenizer; the chat template is applied only where the tokenizer has
    one. --prompt-token-ids and --random-prompt-len give prompts to a model without a
    tokenizer (a shape preset with dummy weights)."""
    tok = llm.tokenizer
    if args.prompt_token_ids is not None or args.random_prompt_len is not None:
        if args.prompt:
            raise ValueError("give text prompts, or --prompt-token-ids / --random-prompt-len, not both")
        if args.prompt_token_ids is not None:
            ids = _parse_token_ids(args.prompt_token_ids, llm.engine.model_config.vocab_size)
        else:
            ids = _random_ids(args.random_prompt_len, llm.engine.model_config.vocab_size)
        return [ids], [f"{len(ids)} token ids"], False
    if not args.prompt:
        raise ValueError("give a prompt (text), or --prompt-token-ids / --random-prompt-len")
    if tok is None:
        raise ValueError(f"{llm.engine.info.model} has no tokenizer, so text prompts cannot be "
                         f"encoded: pass --tokenizer (an HF tokenizer directory or a .gguf file), "
                         f"or token ids with --prompt-token-ids 1,2,3 or --random-prompt-len N")
    if not (args.chat_template and tok.chat_template):
        return list(args.prompt), list(args.prompt), False
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in args.prompt]
    return prompts, list(args.prompt), True


def _parse_token_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be comma-separated integers, got {text!r}") from None
    if not ids or any(not 0 <= i < vocab_size for i in ids):
        raise ValueError(f"--prompt-token-ids must be non-empty ids in [0, {vocab_size}), got {text!r}")
    return ids


def _random_ids(length: int, vocab_size: int) -> list[int]:
    import random
    if length < 1:
        raise ValueError(f"--random-prompt-len must be >= 1, got {length}")
    rng = random.Random(0)
    # From 100 up: skips the special and byte tokens at the start of most vocabularies.
    return [rng.randrange(min(100, vocab_size - 1), vocab_size) for _ in range(length)]


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


class CliParser(argparse.ArgumentParser):
    """argparse, failing fast: no prefix matching (`--max-token` is a typo, not `--max-tokens`),
    and an unknown subcommand, choice or flag names the closest valid ones.

    Subparsers are built with the class of their parent, so every parser of the CLI is one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        # Kept for error(): argparse reports a missing subcommand before unknown flags, and
        # `rooflm --verison` deserves the suggestion more than "a command is required".
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            # Reported by the subcommand's parser that was given them, so the suggestion and the
            # usage line are that command's.
            leaf = _leaf_parser(self, namespace)
            leaf.error(f"unrecognized arguments: {' '.join(extras)}{_flag_suggestions(leaf, extras)}")
        return namespace

    def error(self, message):
        if message.startswith("the following arguments are required"):
            unknown = [a for a in getattr(self, "_given", []) if a.startswith("-")
                       and a.split("=", 1)[0] not in self._option_string_actions]
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}{_flag_suggestions(self, unknown)}"
        super().error(message)

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            close = difflib.get_close_matches(str(value), names, n=3)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{hint}; choose from {', '.join(map(repr, names))}")


def _leaf_parser(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand parser the namespace's subcommand names select."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(namespace, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def _flag_suggestions(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    flags = list(parser._option_string_actions)
    hints = []
    for arg in extras:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            close = difflib.get_close_matches(flag, flags, n=3)
            if close:
                hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    return f" ({'; '.join(hints)})" if hints else ""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="rooflm", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--version", action="version", version=f"rooflm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts with the offline engine")
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt as a user turn of the model's chat template, if it has one")
    gen.add_argument("--prompt-token-ids", default=None,
                     help="one prompt as comma-separated token ids (models without a tokenizer)")
    gen.add_argument("--random-prompt-len", type=int, default=None,
                     help="one prompt of N random token ids (models without a tokenizer)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=512)

    env = sub.add_parser("env", help="the ROOFLM_* environment switches: type, default, current value")
    env.set_defaults(func=cmd_env)

    _register_optional(sub)
    return parser


def cmd_env(args: argparse.Namespace) -> int:
    """One block per switch: name, what it takes, default, value now (hidden for secrets), doc."""
    import os
    for sw in envs.SWITCHES.values():
        raw = os.environ.get(sw.name)
        if raw is None:
            now = "unset"
        elif sw.secret:
            now = "set (hidden)"
        else:
            try:
                sw.read()
                now = repr(raw)
            except envs.EnvError as exc:
                now = f"{raw!r}  <- {exc}"
        print(f"{sw.name}\n    type: {sw.kind}; default: {sw.default_text()}; now: {now}\n    {sw.doc}")
    return 0


def _register_optional(sub) -> None:
    """Subcommands that live with their own subsystem."""
    import importlib
    for module in ("rooflm.perf.commands", "rooflm.server.commands", "rooflm.bench.commands",
                   "rooflm.eval.commands", "rooflm.sim.commands", "rooflm.train.commands",
                   "rooflm.quantize.commands"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("rooflm"):
                continue  # subsystem not present in this build
            raise
        group = mod.register(sub)
        if module == "rooflm.bench.commands":
            # `rooflm bench train`, the training knob sweep, is the training lab's: cli joins the two
            # tools, which do not import each other.
            from rooflm.train import bench as train_bench
            train_bench.register(group)


def main(argv: typing.Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"rooflm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # A command with a partial result prints it on its way out (train: the steps done and the
        # last loss); the rest is this one line, not a traceback.
        print(f"\nrooflm {_command_name(args)}: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED


# The shell's code for a process ended by SIGINT (128 + 2).
INTERRUPTED = 130


def _command_name(args: argparse.Namespace) -> str:
    """`bench serve`, `eval ppl`, `train`: the command and its subcommand, if it has one."""
    sub = getattr(args, f"{args.command}_command", None)  # bench_command, eval_command
    return f"{args.command} {sub}" if isinstance(sub, str) else args.command


if __name__ == "__main__":
    sys.exit(main())
