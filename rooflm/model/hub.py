"""Models named by a Hugging Face Hub repo id: `Qwen/Qwen3-0.6B`, or one GGUF file inside a
repo, `Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf`.

The loader (loader.resolve_model) asks here only for a name that is neither an existing path,
a .gguf file nor a preset. Everything downstream sees a local path: the snapshot directory in
the Hub cache (config.json, tokenizer, safetensors) or the GGUF file, so loading, the
tokenizer and the served name's default work as they do for a directory the user downloaded.

What is fetched is what the loader reads: the config and tokenizer files first, then the
weights that model.safetensors.index.json lists (or model.safetensors). Never *.bin, *.pth or
original/ (Llama's consolidated checkpoints), nor Mistral's consolidated.safetensors beside its
shards, which would double the download.

huggingface_hub does the downloading and keeps its cache layout, so its own environment
switches apply unchanged: HF_HOME / HF_HUB_CACHE (where; --download-dir overrides), HF_TOKEN
(gated and private repos), HF_HUB_OFFLINE (the cache only), HF_ENDPOINT (a mirror). Its errors
become one-line ModelLoadErrors that name the repo and what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional

from rooflm.errors import ModelLoadError

# owner/name as the Hub spells it: word characters, '.' and '-', no '--' or '..' (the Hub
# refuses both); one slash, so that a path with more parts is never taken for a repo.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*\w")
# An optional ':file.gguf' (a path inside the repo) picks one GGUF file of a repo.
_MODEL_NAME = re.compile(rf"(?P<repo>{_REPO_ID.pattern})(?::(?P<gguf>[\w./-]+\.gguf))?",
                         re.IGNORECASE)

SAFETENSORS_SINGLE_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# The files besides the weights that a checkpoint directory is read for: the config, the
# sampling defaults, the index, and every tokenizer file transformers may look for (top level
# only: each is an exact name).
METADATA_FILES = (
    "config.json", "generation_config.json", SAFETENSORS_INDEX_FILE,
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
    "chat_template.jinja", "chat_template.json",
)

@dataclass(frozen=True)
class HubModel:
    """A model named on the Hub: a repo, and optionally one GGUF file in it."""

    repo_id: str
    gguf_file: Optional[str] = None

    def __str__(self) -> str:
        return self.repo_id if self.gguf_file is None else f"{self.repo_id}:{self.gguf_file}"


def parse(model: str) -> Optional[HubModel]:
    """The Hub model a --model value names, or None when it cannot be a repo id (an absolute
    or ./ path, more than one slash, a single name). Says nothing of local paths: the caller
    tries those first, as vLLM does, so a local `owner/name` directory wins."""
    match = _MODEL_NAME.fullmatch(model)
    if match is None:
        return None
    repo_id = match.group("repo")
    # A relative path to a .gguf file that is not there reads as owner/name too: the loader
    # reports it as a missing file instead.
    if "--" in repo_id or ".." in repo_id or repo_id.lower().endswith((".git", ".gguf")):
        return None
    return HubModel(repo_id, match.group("gguf"))


def resolve(model: HubModel, load_format: str, *, revision: Optional[str] = None,
            download_dir: Optional[str] = None) -> tuple[str, str]:
    """(local path, concrete load format) of a Hub model, downloading what is not cached.

    auto / safetensors: the snapshot directory, config, tokenizer and safetensors weights.
    gguf (or a :file.gguf name under auto): the one GGUF file; its tokenizer is inside it.
    dummy: the snapshot directory without weights (the shape and the tokenizer only).
    """
    if model.gguf_file is not None:
        if load_format not in ("auto", "gguf"):
            raise ModelLoadError(
                f"{model}: a GGUF file in a Hub repo loads with --load-format auto or gguf, "
                f"not {load_format}")
        return download_gguf(model, revision=revision, download_dir=download_dir), "gguf"
    if load_format == "gguf":
        raise ModelLoadError(
            f"{model}: --load-format gguf needs one file of the repo: pass "
            f"{model.repo_id}:<file>.gguf")
    if load_format == "dummy":
        directory = download_metadata(model.repo_id, revision=revision, download_dir=download_dir)
        _require_config(model.repo_id, directory, download_dir)
        return directory, "dummy"
    return download_checkpoint(model.repo_id, revision=revision, download_dir=download_dir), "safetensors"


def download_metadata(repo_id: str, *, revision: Optional[str] = None,
                      download_dir: Optional[str] = None) -> str:
    """The snapshot directory holding the repo's config and tokenizer files (no weights): enough
    for a tokenizer, a shape (--load-format dummy) or a roofline."""
    from huggingface_hub import snapshot_download

    with _hub_errors(repo_id, revision, download_dir):
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=list(METADATA_FILES))


def download_checkpoint(repo_id: str, *, revision: Optional[str] = None,
                        download_dir: Optional[str] = None) -> str:
    """The snapshot directory with the config, the tokenizer and the safetensors weights."""
    from huggingface_hub import snapshot_download

    directory = download_metadata(repo_id, revision=revision, download_dir=download_dir)
    _require_config(repo_id, directory, download_dir)
    weights = _weight_files(directory)
    # The snapshot folder is named by its commit: asking for that commit, not the branch,
    # keeps the weights from the same commit as the config even if the branch moved since,
    # and skips a second look-up of the revision.
    commit = os.path.basename(os.path.normpath(directory))
    with _hub_errors(repo_id, revision, download_dir):
        snapshot_download(repo_id, revision=commit, cache_dir=download_dir,
                          allow_patterns=weights)
    missing = [f for f in weights if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise ModelLoadError(_no_safetensors_message(repo_id, directory, missing, download_dir))
    return directory


def download_gguf(model: HubModel, *, revision: Optional[str] = None,
                  download_dir: Optional[str] = None) -> str:
    """The local path of one GGUF file of a repo."""
    from huggingface_hub import hf_hub_download

    with _hub_errors(str(model), revision, download_dir):
        return hf_hub_download(model.repo_id, model.gguf_file, revision=revision,
                               cache_dir=download_dir)


def _require_config(repo_id: str, directory: str, download_dir: Optional[str]) -> None:
    """A checkpoint's shape is its config.json; a repo of GGUF files has none (the shape is
    in each file), and is pointed at one of them."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return
    files = _repo_files(repo_id, os.path.basename(os.path.normpath(directory)), download_dir) or []
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    hint = (f"; load one of its GGUF files as {repo_id}:{ggufs[0]}" if ggufs
            else _offline_hint(directory))
    raise ModelLoadError(
        f"{repo_id}: the Hub repo has no config.json at its top level, so it is no transformers "
        f"checkpoint{hint}")


def _weight_files(directory: str) -> list[str]:
    """The safetensors files the loader will read: the index's shards, else the single file."""
    index_path = os.path.join(directory, SAFETENSORS_INDEX_FILE)
    if not os.path.isfile(index_path):
        return [SAFETENSORS_SINGLE_FILE]
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index_path}: cannot read the shard list: {exc}") from exc


def _repo_files(repo_id: str, commit: str, download_dir: Optional[str]) -> Optional[list[str]]:
    """The repo's file list as huggingface_hub cached it when it listed the repo (no network);
    None where it never did (offline, or a cache laid out by another tool)."""
    from huggingface_hub import get_cached_repo_tree

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit, cache_dir=download_dir)]
    except Exception:  # any miss or unreadable cache means: not known here
        return None


def _no_safetensors_message(repo_id: str, directory: str, missing: list[str],
                            download_dir: Optional[str]) -> str:
    files = _repo_files(repo_id, os.path.basename(os.path.normpath(directory)), download_dir)
    if files is None:
        return (f"{repo_id}: the snapshot {directory} lacks {', '.join(missing[:3])}"
                f"{_offline_hint(directory)}")
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if any(f.endswith(".safetensors") for f in files):
        what = f"its safetensors are not named {', '.join(missing[:3])}"
    else:
        others = [f for f in files if f.endswith((".bin", ".pth", ".pt", ".gguf"))]
        what = (f"it has no *.safetensors weights ({', '.join(others[:3]) or 'no weights at all'})")
    hint = (f"; load one of its GGUF files as {repo_id}:{ggufs[0]}" if ggufs
            else "; rooflm reads safetensors and GGUF checkpoints, not .bin: pick a repo with "
                 "model.safetensors")
    return f"{repo_id}: {what}{hint}"


def _offline_hint(directory: str) -> str:
    from huggingface_hub import is_offline_mode

    if is_offline_mode():
        return (f" (HF_HUB_OFFLINE is set, so only the cached snapshot {directory} was read: "
                f"unset it to download the rest)")
    return ""


def _cache_dir(download_dir: Optional[str]) -> str:
    from huggingface_hub import constants

    return download_dir or constants.HF_HUB_CACHE


@contextlib.contextmanager
def _hub_errors(name: str, revision: Optional[str], download_dir: Optional[str]) -> Iterator[None]:
    """huggingface_hub's exceptions (several lines of advice each) as one-line ModelLoadErrors
    naming the repo and what to do."""
    from huggingface_hub import constants, is_offline_mode
    from huggingface_hub import errors as hub

    at = f" at revision {revision!r}" if revision else ""
    try:
        yield
    except hub.GatedRepoError as exc:  # before RepositoryNotFoundError, its base class
        raise ModelLoadError(
            f"{name}: a gated repo on the Hugging Face Hub{at}; accept its terms at "
            f"{constants.ENDPOINT}/{name.split(':')[0]}, then set HF_TOKEN (or run `hf auth login`) "
            f"to a token of that account") from exc
    except hub.RepositoryNotFoundError as exc:
        raise ModelLoadError(
            f"{name}: no such model repo on the Hugging Face Hub ({constants.ENDPOINT}) and no "
            f"local directory of that name; check the spelling, or set HF_TOKEN if the repo is "
            f"private") from exc
    except hub.RevisionNotFoundError as exc:
        raise ModelLoadError(
            f"{name}: the Hub repo has no revision {revision!r} (a branch, tag or commit); "
            f"check --revision") from exc
    except hub.RemoteEntryNotFoundError as exc:
        raise ModelLoadError(
            f"{name}: the Hub repo{at} has no such file; check the name after the ':' against "
            f"the repo's file list") from exc
    except hub.LocalEntryNotFoundError as exc:
        cache = _cache_dir(download_dir)
        if is_offline_mode():
            raise ModelLoadError(
                f"{name}: not in the Hub cache {cache}{at} and HF_HUB_OFFLINE is set, so nothing "
                f"is downloaded; download it once with network access (unset HF_HUB_OFFLINE), or "
                f"point --download-dir / HF_HOME at a cache that holds it") from exc
        # snapshot_download turns a failed look-up it cannot place (no network, a 5xx, a 403)
        # into this; its cause says which.
        cause = exc.__cause__
        if isinstance(cause, hub.HfHubHTTPError) and cause.response is not None:
            reason = f"the Hub ({constants.ENDPOINT}) answered {cause.response.status_code}"
        else:
            reason = f"cannot reach the Hub ({constants.ENDPOINT})"
        raise ModelLoadError(
            f"{name}: {reason} and it is not in the cache {cache}{at}; check the network (or "
            f"HF_ENDPOINT, HF_TOKEN), or set HF_HUB_OFFLINE=1 with a cache that holds it") from exc
    except hub.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        raise ModelLoadError(
            f"{name}: the Hub ({constants.ENDPOINT}) answered {status}; if the repo is gated or "
            f"private set HF_TOKEN, else try again later") from exc
    except hub.HFValidationError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{name}: not a valid Hub repo id or revision: {reason}") from exc
