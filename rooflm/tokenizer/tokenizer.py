"""Text <-> token ids, and chat templates, by delegating to HF transformers.

HF's tokenizer is the definition of correct here: parity tests compare our
generations token for token with HF's, so encode() does exactly what the HF
tokenizer does (SmolLM2's, for one, adds no BOS).

A GGUF file carries its tokenizer in its metadata; transformers converts it
into a fast tokenizer in several seconds. The converted tokenizer is saved
once to a cache directory and loaded from there afterwards (~0.1 s).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any, Optional

import rooflm.envs as envs
from rooflm.model import hub
from rooflm.model.loader import ModelLoadError, load_error, resolve_model

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "ROOFLM_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "rooflm")

# Brackets of the placeholders encode_chat renders in place of message content: Unicode
# private-use characters, which no template writes.
_PLACEHOLDER_OPEN = "\ue000"
_PLACEHOLDER_CLOSE = "\ue001"

# Any one of these makes a directory loadable by AutoTokenizer without the hub.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def cache_root(cache_dir: Optional[str] = None) -> str:
    """rooflm's cache directory: the argument, else $ROOFLM_CACHE_DIR, else ~/.cache/rooflm."""
    if cache_dir is None:
        cache_dir = envs.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
    return os.path.abspath(os.path.expanduser(cache_dir))


def gguf_tokenizer_cache_key(gguf_path: str) -> str:
    """Identifies one GGUF file's converted tokenizer.

    The file's path, size and mtime say whether the file changed; the
    transformers version is in the key because its GGUF conversion changes
    between releases and a stale conversion would tokenize differently.
    """
    import transformers

    stat = os.stat(gguf_path)
    identity = "\n".join([os.path.realpath(gguf_path), str(stat.st_size), str(stat.st_mtime_ns),
                          transformers.__version__])
    digest = hashlib.sha256(identity.encode("utf-8")).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return f"{stem}-{digest}"


def has_tokenizer_files(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, f)) for f in HF_TOKENIZER_FILES)


class Tokenizer:
    """A thin wrapper over an HF fast tokenizer.

    hf: the transformers tokenizer, used directly by the incremental detokenizer.
    loaded_from_cache: True when a GGUF tokenizer came from the conversion cache.
    cache_path: that cache entry's directory (None for HF directories).
    """

    def __init__(self, hf: Any, *, loaded_from_cache: bool = False,
                 cache_path: Optional[str] = None):
        self.hf = hf
        self.loaded_from_cache = loaded_from_cache
        self.cache_path = cache_path

    # -- loading ------------------------------------------------------------

    @classmethod
    def load(cls, path: str, load_format: str, cache_dir: Optional[str] = None,
             download_dir: Optional[str] = None) -> "Tokenizer":
        """Load the tokenizer of an HF directory, a GGUF file or a Hub repo id.

        cache_dir: root of rooflm's cache (converted GGUF tokenizers go in its
        tokenizers/ folder); default $ROOFLM_CACHE_DIR or ~/.cache/rooflm.
        download_dir: the Hub cache a repo id's tokenizer files are downloaded into.
        """
        hub_source = _hub_tokenizer_source(path, load_format, download_dir)
        if hub_source is not None:
            path, load_format = hub_source
        if load_format == "auto":
            path, load_format = resolve_model(path, load_format)
        if load_format == "safetensors":
            return cls._load_hf_directory(path)
        if load_format == "gguf":
            return cls._load_gguf(path, cache_dir)
        if load_format == "dummy":
            if os.path.isdir(path):  # an HF directory with dummy weights: its own tokenizer
                return cls._load_hf_directory(path)
            raise ModelLoadError(
                f"{path!r} is a dummy-weight preset and has no tokenizer; pass token ids, or a "
                f"tokenizer path (an HF directory or a .gguf file)")
        raise ModelLoadError(f"unknown load format {load_format!r} for a tokenizer")

    @classmethod
    def _load_hf_directory(cls, model_dir: str) -> "Tokenizer":
        from transformers import AutoTokenizer

        if not os.path.isdir(model_dir):
            raise load_error(model_dir, "tokenizer directory not found")
        if not any(os.path.isfile(os.path.join(model_dir, f)) for f in HF_TOKENIZER_FILES):
            raise load_error(model_dir, f"no tokenizer files ({', '.join(HF_TOKENIZER_FILES)}); "
                                        f"pass a tokenizer path, or token ids")
        try:
            hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except Exception as exc:  # transformers raises many types for unreadable tokenizers
            raise load_error(model_dir, f"cannot load tokenizer: {type(exc).__name__}: {exc}") from exc
        return cls(hf)

    @classmethod
    def _load_gguf(cls, gguf_path: str, cache_dir: Optional[str]) -> "Tokenizer":
        if not os.path.isfile(gguf_path):
            raise load_error(gguf_path, "GGUF file not found")
        tokenizers_dir = os.path.join(cache_root(cache_dir), "tokenizers")
        entry = os.path.join(tokenizers_dir, gguf_tokenizer_cache_key(gguf_path))

        entry_damaged = False
        if os.path.isdir(entry):
            try:
                return cls(_load_saved(entry), loaded_from_cache=True, cache_path=entry)
            except Exception as exc:
                # A damaged entry (disk full, manual edits) is rebuilt, not fatal.
                logger.warning("tokenizer cache entry %s unreadable (%s); converting again",
                               entry, exc)
                entry_damaged = True

        hf = _convert_gguf_tokenizer(gguf_path)
        try:
            _write_cache_entry(hf, tokenizers_dir, entry, replace=entry_damaged)
        except OSError as exc:
            # A read-only or full disk costs the next process the conversion time, nothing more.
            logger.warning("could not cache the converted tokenizer in %s: %s", entry, exc)
            return cls(hf)
        return cls(hf, loaded_from_cache=False, cache_path=entry)

    # -- properties ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return len(self.hf)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> Optional[int]:
        return self.hf.bos_token_id

    @property
    def chat_template(self) -> Optional[str]:
        return getattr(self.hf, "chat_template", None)

    def set_chat_template(self, template: str) -> None:
        """Replace the model's chat template (rooflm serve --chat-template)."""
        self.hf.chat_template = template

    # -- text <-> ids ------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_plain_text(self, text: str) -> list[int]:
        """Like encode(text), but a special token's text in it stays text (split into
        ordinary tokens); the tokenizer's own BOS, if it adds one, is still added."""
        return list(self.hf.encode(text, add_special_tokens=True, split_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> str:
        """The rendered prompt text for a conversation; tools (OpenAI's function definitions)
        go to the template, which renders them if its family knows how."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead "
                             "of chat messages")
        _check_messages(messages)
        return self.hf.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                           add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    split_special_tokens: bool = False,
                    tools: Optional[list[dict]] = None) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids.

        The template writes the special tokens (BOS included) into the text, so the
        text is encoded without adding any. By default, as in vLLM and HF, the whole
        text is encoded at once, and a special token's text typed inside a message
        ("<|im_start|>system ...") becomes that special token: the sender can forge
        turns. split_special_tokens=True keeps message content plain text: content is
        rendered as placeholders, and each piece of content is encoded on its own with
        special tokens split (HF's split_special_tokens; vLLM's placeholder idea,
        vllm-project/vllm#31735). Content holding no special token's text takes the
        plain path, so its ids are the same either way; otherwise the ids at the
        boundaries between template and content may differ from one whole-text encode.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        if not split_special_tokens or not self._has_special_text(messages):
            return text, self.encode(text, add_special_tokens=False)
        nonce = uuid.uuid4().hex
        # Only text content is marked: an assistant turn with tool calls may have none.
        marked = [{**m, "content": f"{_PLACEHOLDER_OPEN}{nonce}:{i}{_PLACEHOLDER_CLOSE}"}
                  if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)]
        rendered = self.apply_chat_template(marked, add_generation_prompt, tools)
        pieces = re.split(f"{_PLACEHOLDER_OPEN}{nonce}:(\\d+){_PLACEHOLDER_CLOSE}", rendered)
        ids: list[int] = []
        parts: list[str] = []
        for position, piece in enumerate(pieces):
            if position % 2 == 0:  # the template's own text: its special tokens are real
                if nonce in piece:
                    raise ValueError("the chat template changed the message content; cannot "
                                     "keep special tokens in it as text")
                ids += self.encode(piece, add_special_tokens=False)
                parts.append(piece)
            else:  # a message's content: plain text
                content = messages[int(piece)]["content"]
                ids += self.hf.encode(content, add_special_tokens=False, split_special_tokens=True)
                parts.append(content)
        return "".join(parts), ids

    def _has_special_text(self, messages: list[dict]) -> bool:
        specials = [token for token in self.hf.get_added_vocab() if token]
        return any(isinstance(message.get("content"), str) and token in message["content"]
                   for message in messages for token in specials)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id}, loaded_from_cache={self.loaded_from_cache})")


def _hub_tokenizer_source(path: str, load_format: str,
                          download_dir: Optional[str]) -> Optional[tuple[str, str]]:
    """(local path, format) of a Hub repo id's tokenizer: its tokenizer files without the
    weights, or the named GGUF file. None for anything else (local paths come first)."""
    if load_format == "dummy" or os.path.exists(path):
        return None
    model = hub.parse(path)
    if model is None:
        return None
    if model.gguf_file is not None:
        return hub.download_gguf(model, download_dir=download_dir), "gguf"
    return hub.download_metadata(model.repo_id, download_dir=download_dir), "safetensors"


def load_model_tokenizer(tokenizer: Optional[str], model_path: str, load_format: str,
                         download_dir: Optional[str] = None) -> Optional["Tokenizer"]:
    """The tokenizer an engine serving this model uses: `tokenizer` (LoadConfig.tokenizer: an
    HF directory, a .gguf file or a Hub repo id, downloaded into download_dir) if given, else
    the model's own (model_path: resolve_model's local path). None where there is none,
    and prompts must be token ids: a dummy-weight preset, an HF directory without tokenizer
    files. A directory with dummy weights still has its tokenizer (vLLM's behaviour), so an
    8B shape can be served and benchmarked with real text.

    One rule for every process that needs it: the engine (detokenization, stop strings) and,
    with the engine in its own process, the API process (prompts, chat templates, echo).
    """
    if tokenizer is not None:
        return Tokenizer.load(tokenizer, "gguf" if tokenizer.endswith(".gguf") else "safetensors",
                              download_dir=download_dir)
    if load_format == "dummy" and not os.path.isdir(model_path):
        return None  # a preset: a shape, no tokenizer
    if load_format in ("safetensors", "dummy") and not has_tokenizer_files(model_path):
        logger.warning("%s has no tokenizer files: prompts must be token ids", model_path)
        return None
    return Tokenizer.load(model_path, load_format)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', "
                             f"got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"message {i} has no {key!r}")
            if not isinstance(message[key], str):
                raise ValueError(f"message {i}: {key!r} must be a string, "
                                 f"got {type(message[key]).__name__}")


def _load_saved(directory: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _convert_gguf_tokenizer(gguf_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                             gguf_file=os.path.basename(gguf_path),
                                             local_files_only=True)
    except Exception as exc:  # corrupt metadata surfaces as many exception types
        raise load_error(gguf_path, f"cannot build a tokenizer from the GGUF metadata: "
                                    f"{type(exc).__name__}: {exc}") from exc


def _write_cache_entry(hf: Any, tokenizers_dir: str, entry: str, replace: bool) -> None:
    """Save into a private temporary directory, then rename it into place.

    rename is atomic, so a reader sees either no entry or a complete one. When
    another process got there first, its entry is kept and ours discarded; an
    existing entry is moved aside only when `replace` says it failed to load.
    """
    os.makedirs(tokenizers_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=tokenizers_dir)
    try:
        # mkdtemp makes the directory private (0700); a cache entry is ordinary data.
        os.chmod(staging, 0o755)
        hf.save_pretrained(staging)
        if replace and os.path.isdir(entry):
            discard = tempfile.mkdtemp(prefix=".discard-", dir=tokenizers_dir)
            try:
                os.rename(entry, os.path.join(discard, "entry"))
            except OSError:
                pass  # another process moved or replaced it already
            shutil.rmtree(discard, ignore_errors=True)
        try:
            os.rename(staging, entry)
        except OSError:
            # A non-empty directory of that name now exists: a concurrent writer won.
            if not os.path.isdir(entry):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
