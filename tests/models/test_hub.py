"""Models named by a Hugging Face Hub repo id (rooflm/model/hub.py), never over the network.

Two stand-ins for the Hub: a Hub cache laid out here as huggingface_hub lays it out (blobs/,
refs/main, snapshots/<commit>/), read with HF_HUB_OFFLINE=1; and a fake Hub on 127.0.0.1 that
answers the four routes snapshot_download and hf_hub_download call (repo info, the file tree,
and HEAD/GET of a file), which HF_ENDPOINT points a subprocess at. huggingface_hub reads its
environment (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE) when imported, so the endpoint tests run
the resolution in a fresh process with the environment a user would set.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from typing import Optional
from urllib.parse import unquote, urlparse

import pytest

from rooflm.errors import ModelLoadError
from rooflm.model import hub
from rooflm.model.loader import resolve_model
from tests.models.tiny_models import make_tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(300)

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REVISIONS = ("main", "v1.0", COMMIT)  # the fake Hub's: every one names COMMIT
SUBPROCESS_TIMEOUT_S = 240  # a bound on a fresh interpreter's imports on a loaded machine


# ---------------------------------------------------------------------------
# A tiny model with a tokenizer (tests/models/tiny_models.py), and a repo's files
# ---------------------------------------------------------------------------

def _read_dir(path: str) -> dict[str, bytes]:
    files = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            files[name] = f.read()
    return files


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    """The tiny checkpoint's files (config, safetensors, tokenizer), as a repo holds them."""
    return _read_dir(make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-hub")))


def lay_out_cache(cache_dir, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> str:
    """A Hub cache entry as huggingface_hub writes one: content-addressed blobs, the snapshot's
    files as relative links to them, and refs/main naming the commit. Returns the snapshot."""
    storage = os.path.join(os.fspath(cache_dir), "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", commit)
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(storage, "blobs", blob), "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, *name.split("/"))
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(os.path.join(storage, "blobs", blob), os.path.dirname(link)), link)
    with open(os.path.join(storage, "refs", "main"), "w") as f:
        f.write(commit)
    return snapshot


# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("Qwen/Qwen3-0.6B", hub.HubModel("Qwen/Qwen3-0.6B")),
    ("Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf", hub.HubModel("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf")),
    ("org/repo:sub/model.Q4_K.gguf", hub.HubModel("org/repo", "sub/model.Q4_K.gguf")),
    ("gpt2", None),                  # one name: a preset typo more often than a Hub repo
    ("/abs/dir", None), ("./rel/dir", None), ("~/dir", None),
    ("a/b/c", None),                 # a path of three parts
    ("models/missing.gguf", None),   # a relative GGUF path: reported as a missing file
    ("a--b/c", None), ("a/b..c", None), ("org/repo:notes.txt", None),
])
def test_which_names_are_repo_ids(name, expected):
    assert hub.parse(name) == expected


def test_a_local_directory_named_like_a_repo_wins(tmp_path, monkeypatch, tiny_files):
    local = tmp_path / "tiny-org" / "tiny-llama"
    local.mkdir(parents=True)
    for name, data in tiny_files.items():
        (local / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO, "auto") == (REPO, "safetensors")


def test_served_model_name_defaults_to_the_repo_id_as_given():
    from rooflm.server.config import derive_model_name
    assert derive_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert derive_model_name("/models/Qwen3-0.6B") == "Qwen3-0.6B"


# ---------------------------------------------------------------------------
# (a) A Hub cache laid out here, HF_HUB_OFFLINE=1
# ---------------------------------------------------------------------------

@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for this process: huggingface_hub read its environment when first
    imported, so its constant is set as well."""
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_offline_cache_resolves_to_its_snapshot(tmp_path, offline, tiny_files):
    snapshot = lay_out_cache(tmp_path / "hub", REPO, tiny_files)
    assert resolve_model(REPO, "auto", download_dir=str(tmp_path / "hub")) == (snapshot, "safetensors")
    assert resolve_model(REPO, "dummy", download_dir=str(tmp_path / "hub")) == (snapshot, "dummy")
    assert resolve_model(REPO, "auto", revision=COMMIT,
                         download_dir=str(tmp_path / "hub")) == (snapshot, "safetensors")


def test_llm_generates_from_a_repo_id_in_the_offline_cache(tmp_path, offline, tiny_files):
    from rooflm import LLM, SamplingParams

    lay_out_cache(tmp_path / "hub", REPO, tiny_files)
    llm = LLM(model=REPO, download_dir=str(tmp_path / "hub"), device="cpu", dtype="float32")
    [out] = llm.generate(["w10 w11 w12"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
    assert llm.engine.info.model == REPO
    assert llm.tokenizer.encode("w10 w11") == [10, 11]  # the repo's own tokenizer


def test_offline_repo_not_in_cache_is_one_line_naming_it(tmp_path, offline):
    with pytest.raises(ModelLoadError) as info:
        resolve_model("nobody/absent", "auto", download_dir=str(tmp_path / "hub"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("nobody/absent: not in the Hub cache")
    assert "HF_HUB_OFFLINE" in message


def test_offline_cache_without_safetensors_says_so(tmp_path, offline, tiny_files):
    files = {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
    lay_out_cache(tmp_path / "hub", REPO, files)
    with pytest.raises(ModelLoadError, match=r"^tiny-org/tiny-llama: .*lacks model\.safetensors.*HF_HUB_OFFLINE"):
        resolve_model(REPO, "auto", download_dir=str(tmp_path / "hub"))


def test_tokenizer_of_a_repo_id_needs_no_weights(tmp_path, offline, tiny_files):
    """--tokenizer owner/name: the tokenizer files only, from the Hub cache."""
    from rooflm.tokenizer.tokenizer import load_model_tokenizer

    files = {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
    snapshot = lay_out_cache(tmp_path / "hub", REPO, files)
    tokenizer = load_model_tokenizer(REPO, "unused-model-path", "safetensors",
                                     download_dir=str(tmp_path / "hub"))
    assert tokenizer.encode("w10 w11") == [10, 11]
    assert not os.path.exists(os.path.join(snapshot, "model.safetensors"))


def test_roofline_shape_of_a_repo_id_needs_no_weights(tmp_path, offline, monkeypatch, tiny_files):
    """roofline / memory read the config only: a cached snapshot without weights is enough."""
    from huggingface_hub import constants
    from rooflm.perf.commands import resolve_model_config

    files = {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
    lay_out_cache(tmp_path / "hub", REPO, files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = resolve_model_config(REPO)
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)


def test_cli_generates_from_a_repo_id_under_hf_home(tmp_path, tiny_files):
    """HF_HOME and HF_HUB_OFFLINE as a user sets them; the CLI finds the cache under HF_HOME/hub."""
    lay_out_cache(tmp_path / "hf" / "hub", REPO, tiny_files)
    env = _clean_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "rooflm", "generate", "w10 w11", "--model", REPO, "--device", "cpu",
         "--dtype", "float32", "--max-tokens", "3", "--ignore-eos", "--no-chat-template"],
        env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), result.stderr[-3000:]


# ---------------------------------------------------------------------------
# (b) A fake Hub on 127.0.0.1
# ---------------------------------------------------------------------------

class FakeHub:
    """The Hub's routes that a snapshot download uses, over repos held in memory.

    repos: repo id -> {path: bytes}. gated: repo id -> the status its files answer (401 or
    403, with X-Error-Code GatedRepo, as the Hub answers without an accepted token; its info
    and file list stay public). Every request's path is recorded in `requested`.
    """

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: Optional[dict[str, int]] = None):
        self.repos = repos
        self.gated = gated or {}
        self.requested: list[str] = []
        self._lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()  # returns once serve_forever's loop has seen it (one poll)
        self.server.server_close()
        self.thread.join(timeout=30)

    def downloaded(self, repo_id: str) -> set[str]:
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            return {p[len(prefix):].split("/", 1)[1] for p in self.requested if p.startswith(prefix)}

    def _handler(self):
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output to the test's own
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool):
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _json(self, value, body: bool):
                self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"}, body)

            def _error(self, status: int, code: str, body: bool):
                self._send(status, json.dumps({"error": code}).encode(),
                           {"X-Error-Code": code, "X-Error-Message": code}, body)

            def _answer(self, body: bool):
                path = unquote(urlparse(self.path).path)
                with fake._lock:
                    fake.requested.append(path)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo_id, route = "/".join(parts[2:4]), parts[4]
                    if repo_id not in fake.repos:
                        return self._error(404, "RepoNotFound", body)
                    files = fake.repos[repo_id]
                    if parts[5] not in REVISIONS:
                        return self._error(404, "RevisionNotFound", body)
                    if route == "revision":  # repo info: its commit
                        return self._json({"id": repo_id, "sha": COMMIT,
                                           "siblings": [{"rfilename": f} for f in files]}, body)
                    if route == "tree":  # the recursive file list
                        return self._json([{"type": "file", "path": f, "size": len(data),
                                            "oid": hashlib.sha1(data).hexdigest()}
                                           for f, data in files.items()], body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, filename = "/".join(parts[:2]), "/".join(parts[4:])
                    if repo_id not in fake.repos:
                        return self._error(404, "RepoNotFound", body)
                    if repo_id in fake.gated:
                        return self._error(fake.gated[repo_id], "GatedRepo", body)
                    if filename not in fake.repos[repo_id]:
                        return self._error(404, "EntryNotFound", body)
                    data = fake.repos[repo_id][filename]
                    return self._send(200, data, {"X-Repo-Commit": COMMIT,
                                                  "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, body)
                self._error(404, "RepoNotFound", body)

        return Handler


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without proxies, tokens or Hub settings, plus `extra`."""
    dropped = ("HF_", "HUGGING", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "TRANSFORMERS_")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(dropped)}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


# Resolves argv[1] (load format argv[2]) with rooflm's loader front door and prints the path
# and format as JSON, or "ModelLoadError: <message>".
_RESOLVE = """
import json, sys
from rooflm.errors import ModelLoadError
from rooflm.model import hub
try:
    name = hub.parse(sys.argv[1])
    print(json.dumps(hub.resolve(name, sys.argv[2], revision=sys.argv[3] or None)))
except ModelLoadError as exc:
    print("ModelLoadError: " + str(exc))
"""


def _resolve_via(fake: FakeHub, tmp_path, name: str, load_format: str = "auto",
                 revision: str = "") -> str:
    env = _clean_env(HF_ENDPOINT=fake.endpoint, HF_HOME=str(tmp_path / "hf"),
                     HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    result = subprocess.run([sys.executable, "-c", _RESOLVE, name, load_format, revision],
                            env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_download_from_the_fake_hub_fetches_config_tokenizer_and_safetensors_only(tmp_path, tiny_files):
    repo = dict(tiny_files)
    repo.update({"pytorch_model.bin": b"pickle", "original/consolidated.00.pth": b"pickle",
                 "README.md": b"# tiny"})
    with FakeHub({REPO: repo}) as fake:
        path, fmt = json.loads(_resolve_via(fake, tmp_path, REPO))
        downloaded = fake.downloaded(REPO)
    assert fmt == "safetensors"
    assert path == str(tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT)
    assert downloaded == set(tiny_files)  # no .bin, no original/, no README
    assert _read_dir(path) == tiny_files
    # What was downloaded loads: the config, and the weights through the loader.
    from rooflm.model.loader import iter_weights, load_model_config
    config = load_model_config(path, "safetensors")
    assert config.num_hidden_layers == 2
    assert sum(1 for _ in iter_weights(path, "safetensors")) > 0


def test_sharded_checkpoint_downloads_the_indexed_shards_not_consolidated(tmp_path):
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                             "b": "model-00002-of-00002.safetensors"}}
    repo = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
            "model-00001-of-00002.safetensors": b"shard1", "model-00002-of-00002.safetensors": b"shard2",
            "consolidated.safetensors": b"both shards again"}
    with FakeHub({"org/sharded": repo}) as fake:
        path, fmt = json.loads(_resolve_via(fake, tmp_path, "org/sharded", revision="main"))
        downloaded = fake.downloaded("org/sharded")
    assert downloaded == set(repo) - {"consolidated.safetensors"}
    assert sorted(os.listdir(path)) == sorted(set(repo) - {"consolidated.safetensors"})


def test_gguf_file_of_a_repo(tmp_path):
    repo = {"model-Q4_0.gguf": b"GGUF...", "model-Q8_0.gguf": b"GGUF8..."}
    with FakeHub({"org/m-GGUF": repo}) as fake:
        path, fmt = json.loads(_resolve_via(fake, tmp_path, "org/m-GGUF:model-Q8_0.gguf"))
        assert fake.downloaded("org/m-GGUF") == {"model-Q8_0.gguf"}
        missing = _resolve_via(fake, tmp_path, "org/m-GGUF:model-F16.gguf")
        whole_repo = _resolve_via(fake, tmp_path, "org/m-GGUF")
    assert fmt == "gguf" and open(path, "rb").read() == b"GGUF8..."
    assert whole_repo == ("ModelLoadError: org/m-GGUF: the Hub repo has no config.json at its top "
                          "level, so it is no transformers checkpoint; load one of its GGUF files "
                          "as org/m-GGUF:model-Q4_0.gguf")
    assert missing.startswith("ModelLoadError: org/m-GGUF:model-F16.gguf: the Hub repo has no such file")


def test_missing_repo_is_one_line_naming_it(tmp_path):
    with FakeHub({}) as fake:
        line = _resolve_via(fake, tmp_path, "nobody/no-such-model")
    assert line.startswith("ModelLoadError: nobody/no-such-model: no such model repo on the "
                           "Hugging Face Hub")
    assert fake.endpoint in line


@pytest.mark.parametrize("status", [401, 403])
def test_gated_repo_is_one_line_naming_it_and_the_token(tmp_path, tiny_files, status):
    with FakeHub({"meta-org/gated": dict(tiny_files)}, gated={"meta-org/gated": status}) as fake:
        line = _resolve_via(fake, tmp_path, "meta-org/gated")
    assert line.startswith("ModelLoadError: meta-org/gated: a gated repo on the Hugging Face Hub")
    assert "HF_TOKEN" in line


def test_repo_without_safetensors_names_what_it_has(tmp_path):
    repo = {"config.json": b"{}", "pytorch_model.bin": b"pickle", "model-Q4_0.gguf": b"GGUF"}
    with FakeHub({"org/bin-only": repo}) as fake:
        line = _resolve_via(fake, tmp_path, "org/bin-only")
    assert line.startswith("ModelLoadError: org/bin-only: it has no *.safetensors weights")
    assert "org/bin-only:model-Q4_0.gguf" in line


def test_revision_reaches_the_hub_and_an_unknown_one_is_named(tmp_path, tiny_files):
    with FakeHub({REPO: dict(tiny_files)}) as fake:
        path, _ = json.loads(_resolve_via(fake, tmp_path, REPO, revision="v1.0"))
        unknown = _resolve_via(fake, tmp_path, REPO, revision="no-such-branch")
        requested = list(fake.requested)
    assert f"/api/models/{REPO}/revision/v1.0" in requested
    assert path.endswith(COMMIT)
    assert unknown == (f"ModelLoadError: {REPO}: the Hub repo has no revision 'no-such-branch' "
                       f"(a branch, tag or commit); check --revision")
