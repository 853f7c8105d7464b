"""--chat-template: a Jinja chat template that replaces the model's, from a file or given inline.

As vLLM reads it: a value naming an existing file is that file's text; a value
that looks like a path (no Jinja markup, ends in .jinja / .j2 / .txt, or has a
path separator) but names no file is an error, not a one-line template; anything
else is the template itself. It is checked at start-up, before the model loads
(it must compile), and again once the tokenizer exists (it must render a short
conversation), so a broken template stops `rooflm serve` with a clear message
instead of failing every chat request.
"""

from __future__ import annotations

import os

# What the start-up check renders: one user turn, which every chat template takes (some refuse
# a system turn, or turns that do not alternate, and are still good templates).
SAMPLE_CONVERSATION = [{"role": "user", "content": "Hello"}]
_PATH_SUFFIXES = (".jinja", ".jinja2", ".j2", ".txt", ".tmpl")


class ChatTemplateError(ValueError):
    """The --chat-template value is unusable; the message says why."""


def _looks_like_path(value: str) -> bool:
    if "{{" in value or "{%" in value:
        return False
    return value.lower().endswith(_PATH_SUFFIXES) or os.sep in value or value.startswith(("~", "."))


def load_chat_template(value: str) -> str:
    """The template text for a --chat-template value; raises ChatTemplateError."""
    if not value.strip():
        raise ChatTemplateError("--chat-template is empty")
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read the chat template file {value!r}: {exc}") from None
    elif _looks_like_path(value):
        raise ChatTemplateError(f"the chat template file {value!r} does not exist (pass a file "
                                f"path or the template itself)")
    else:
        text = value
    check_syntax(text)
    return text


def check_syntax(template: str) -> None:
    """Compile the template in the sandbox HF renders chat templates in."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc.message} (line "
                                f"{exc.lineno})") from None


def install_chat_template(tokenizer, template: str) -> None:
    """Make `template` the tokenizer's chat template, once it renders a sample conversation."""
    if tokenizer is None:
        raise ChatTemplateError("--chat-template was given but the model has no tokenizer")
    tokenizer.set_chat_template(template)
    try:
        rendered = tokenizer.apply_chat_template(SAMPLE_CONVERSATION, True)
    except Exception as exc:  # noqa: BLE001 - jinja2 raises many types; all mean "unusable"
        raise ChatTemplateError(f"the chat template fails on a sample conversation: "
                                f"{type(exc).__name__}: {exc}") from None
    if not isinstance(rendered, str) or "Hello" not in rendered:
        raise ChatTemplateError("the chat template does not render the messages' content "
                                "(the sample user turn's text is missing from its output)")
