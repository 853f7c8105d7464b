"""Every ROOFLM_* environment switch, in one table: name, type, default and what it does.

Code reads a switch through this module, never through os.environ:

    envs.get("ROOFLM_PDL")     # parsed now, from os.environ (start-up, model load, a hook)
    envs.ROOFLM_PDL            # the same, as an attribute
    envs.cached.ROOFLM_PDL     # on a kernel's launch path: parsed at its first use, then kept

`get` costs an environment read and a parse (about a microsecond), so a path that runs per
layer and step reads `cached` instead: a plain attribute once the first read stored it, as
cheap as the module constant it replaces. A process decides those switches once, as the
constants read at import did, except that the first use decides, not the import.
`put(name, value)` sets a switch from then on (A/B benchmarks that run both sides in one
process) and `override(name, value)` for a block (tests): both write os.environ and drop the
cached value; `override` restores both on exit.

A value that does not parse raises EnvError naming the variable and what it takes.
`rooflm env` prints the table with each switch's current value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator, Optional


class EnvError(ValueError):
    """A ROOFLM_* variable whose value cannot be parsed; the message names it."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError


def _seconds(raw: str) -> float:
    seconds = float(raw)
    if seconds < 0:
        raise ValueError
    return seconds


def _ints(raw: str) -> tuple[int, ...]:
    return tuple(int(part) for part in raw.split(","))


def _rank_step(raw: str) -> tuple[int, int]:
    rank, step = (int(part) for part in raw.split(":"))
    return rank, step


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError
        return raw
    return parse


@dataclasses.dataclass(frozen=True)
class Switch:
    """One environment variable. kind: what it takes, in the words an error and `rooflm env`
    print. An unset or empty variable is the default. secret: `rooflm env` hides its value."""

    name: str
    kind: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    secret: bool = False

    def default_text(self) -> str:
        """The default as it would be written in the environment."""
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)

    def read(self) -> Any:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise EnvError(f"{self.name} must be {self.kind}, got {raw!r}") from None


_ON_OFF = "0 or 1"

SWITCHES: dict[str, Switch] = {s.name: s for s in (
    # Kernel A/B switches: the benchmarks turn a fast path off to measure what it is worth.
    Switch("ROOFLM_PDL", _ON_OFF, _bool, True,
           "programmatic dependent launch for the decode-path kernels (Hopper and later); 0: off"),
    Switch("ROOFLM_GEMV_TUNED", _ON_OFF, _bool, True,
           "the batch-1 GEMV's launch shape from kernels/tuned/gemv.json per GPU and weight shape; 0: one default"),
    Switch("ROOFLM_TF32", _ON_OFF, _bool, True,
           "fp32 matmuls (--dtype float32) on TF32 tensor cores; 0: full fp32 (numerics checks)"),
    Switch("ROOFLM_FP8_PAIRS", _ON_OFF, _bool, True,
           "FP8 KV tiles loaded and widened two bytes at a time; 0: a byte at a time"),
    Switch("ROOFLM_FP8_DECODE_MMA", _ON_OFF, _bool, True,
           "the CUDA mma kernel for FP8-KV decode attention where it applies; 0: the Triton kernel"),
    Switch("ROOFLM_FP8_DECODE_CONFIG", "comma-separated integers w,d,m,s,h", _ints, None,
           "the FP8 decode mma kernel's config (warps, depth, minb, stages, heads_fast); unset: tuned"),
    Switch("ROOFLM_DECODE_ONE_ENTRY", "auto, 1 or 0", _choice("auto", "1", "0"), "auto",
           "decode attention reads a key tile from one block-table entry; auto: with one split"),
    Switch("ROOFLM_SMALL_M_TILES", "1, 0 or deep", _choice("1", "0", "deep"), "1",
           "batch 2-8 linears through the persistent matmul's small tiles; 0: F.linear; "
           "deep: only deep or wide weights"),
    Switch("ROOFLM_DETERMINISTIC_MAX_SPLITS", "an integer >= 1", int, 1,
           "--deterministic: most fixed K splits of a matmul (1: no split)"),
    Switch("ROOFLM_W4_ASM", _ON_OFF, _bool, True,
           "int4 weights unpacked by inline PTX; 0: Triton's own unpacking"),
    Switch("ROOFLM_W4_FUSED_REDUCE", _ON_OFF, _bool, True,
           "int4 split-K partials summed by each tile's last program; 0: a second launch"),
    Switch("ROOFLM_W4_MMA", _ON_OFF, _bool, True,
           "int4 linears with M <= 8 through the hand-written mma.sync kernel; 0: Triton for every M"),
    Switch("ROOFLM_W4_MMA_RELEASE", "0, 1 or 2", lambda raw: int(_choice("0", "1", "2")(raw)), 2,
           "where an int4 mma block releases the next kernel: 0 its end, 1 its start, 2 after its main loop"),
    Switch("ROOFLM_W4_SILU_MUL", _ON_OFF, _bool, True,
           "int4 gated MLPs apply SiLU-mul in gate_up's epilogue; 0: a kernel of its own"),
    Switch("ROOFLM_W4_FOLD", _ON_OFF, _bool, True,
           "the one-token int4 layer folds its RMSNorms into the linears; 0: separate launches"),
    Switch("ROOFLM_FP8_FUSED_QUANT", _ON_OFF, _bool, True,
           "FP8 W8A8 linears take the codes the norm and SiLU-mul write; 0: each quantizes its input"),
    Switch("ROOFLM_FP8_FAST_ACCUM", _ON_OFF, _bool, True,
           "FP8 products accumulate fast (_scaled_mm use_fast_accum); 0: promote to fp32"),
    Switch("ROOFLM_FUSED_SAMPLING", _ON_OFF, _bool, True,
           "temperature-only batches on CUDA sample in one Triton kernel; 0: the torch path"),
    # The CPU's own kernels.
    Switch("ROOFLM_NATIVE_KERNELS", _ON_OFF, _bool, True,
           "the C block matmuls for GGUF weights on the CPU; 0: torch's kernels"),
    Switch("ROOFLM_NATIVE_DECODE", _ON_OFF, _bool, True,
           "one-token CPU steps through the native C decoder where the model fits it; 0: off"),
    Switch("ROOFLM_CPU_CONTENTION", "auto, on or off", _choice("auto", "on", "off"), "auto",
           "a CPU engine core's threads and OpenMP wait policy on a shared machine "
           "(engine/cpu_threads.py): auto decides from the load average at start-up; on: as if "
           "other work were running; off: torch's defaults"),
    Switch("ROOFLM_CPU_THREADS", "an integer >= 0", int, 0,
           "pins a CPU engine core's torch threads (`rooflm serve --cpu-threads`); 0: chosen "
           "by ROOFLM_CPU_CONTENTION"),
    # Places and identities.
    Switch("ROOFLM_CACHE_DIR", "a directory", str, None,
           "rooflm's cache (converted tokenizers, built C kernels); unset: ~/.cache/rooflm"),
    Switch("ROOFLM_API_KEY", "a string", str, None,
           "`rooflm serve`'s API key when --api-key is not given", secret=True),
    Switch("ROOFLM_COMMIT", "a commit id", str, None,
           "the commit benchmark results record where the tree has no .git"),
    # Serving.
    Switch("ROOFLM_ALLOW_RUNTIME_LORA_UPDATING", _ON_OFF, _bool, False,
           "the server's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING); 0: they answer 404"),
    Switch("ROOFLM_PP_LAYER_PARTITION", "comma-separated layer counts, one per stage", _ints, None,
           "pipeline parallelism: the layers each stage holds (vLLM's VLLM_PP_LAYER_PARTITION); "
           "unset: an even split, the remainder to the last stages"),
    # Diagnostics.
    Switch("ROOFLM_ENGINE_CORE_PROFILE", "a file path", str, None,
           "the engine core process's serving loop runs under cProfile; stats written there at exit"),
    Switch("ROOFLM_TP_WORKER_PROFILE", "a directory", str, None,
           "each tensor-parallel worker's step loop runs under cProfile; stats written there at stop"),
    Switch("ROOFLM_TP_STEP_TIMES", _ON_OFF, _bool, False,
           "each tensor-parallel worker prints where its host time went, at stop"),
    Switch("ROOFLM_HANG_DUMP_S", "a number of seconds", _seconds, 0.0,
           "a tensor-parallel rank without progress for this long prints its stacks; 0: never"),
    # Test hooks.
    Switch("ROOFLM_FAULT_INJECT_STEP", "an integer", int, None,
           "test hook: the N-th engine step raises"),
    Switch("ROOFLM_TP_FAULT_INJECT", "RANK:STEP (two integers)", _rank_step, None,
           "test hook: tensor-parallel worker RANK raises at its STEP-th step"),
)}


def switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not a rooflm environment switch (rooflm/envs.py lists them)") from None


def get(name: str) -> Any:
    """The switch's value now: parsed from os.environ, or its default when unset."""
    return switch(name).read()


class _Cached:
    """Switches read on launch paths: the first read of each is stored as an attribute, so
    the next ones are plain attribute loads (__getattr__ runs only on a miss)."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("ROOFLM_"):
            raise AttributeError(name)
        value = get(name)
        setattr(self, name, value)
        return value

    def forget(self, name: str) -> None:
        self.__dict__.pop(name, None)


cached = _Cached()


def put(name: str, value: Optional[str]) -> None:
    """Set the switch from here on (as it would be written in the environment; None: unset),
    for `get` and `cached` alike: an A/B benchmark that runs both sides in one process."""
    _write(name, value)
    get(name)  # a bad value fails here, where it was set, not at a launch later


def _write(name: str, value: Optional[str]) -> None:
    switch(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    cached.forget(name)


@contextlib.contextmanager
def override(name: str, value: Optional[str]) -> Iterator[None]:
    """put(name, value) inside the block, the switch as it was after it (tests)."""
    before = os.environ.get(name)
    try:
        put(name, value)
        yield
    finally:
        _write(name, before)  # as it was, even a value that does not parse


def __getattr__(name: str) -> Any:
    if name in SWITCHES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
