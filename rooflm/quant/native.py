"""rooflm's own CPU block matmuls (csrc/block_matmul.c), built with the system's C compiler at
first use and loaded with ctypes.

Why: torch's weight-only int4 CPU kernel (aten._weight_int4pack_mm_for_cpu) dequantizes to
float and runs at ~3.4 GB/s of weights on one core of the project's AMD EPYC (AVX2): 17.8 ms
for SmolLM2-135M's 30 layers a token, more than llama.cpp's whole token (16.4 ms). The C
kernel quantizes the activations to int8 per block of 32, as llama.cpp does, plus a second int8
level for the remainder (about 15 bits: the matmul's relative error is 2e-5, against 3e-3 for
torch's bf16 activations), and multiplies 32 codes at a time with integer instructions (AVX2
maddubs): 11-12 ms for those 30 layers on the same core. Threads: OpenMP, the same
libgomp torch loaded (same soname), torch.get_num_threads() of them.

Built once per source version into ~/.cache/rooflm (or $ROOFLM_CACHE_DIR): `cc -O3 -mavx2
-mfma -mf16c -fopenmp`, about a second. Where there is no compiler, no AVX2/FMA/F16C, or
ROOFLM_NATIVE_KERNELS=0, `library()` is None and rooflm/quant/linear_method.py uses torch's
kernels instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

import rooflm.envs as envs

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# One library: the block matmuls and the whole-layer decoder (rooflm/quant/native_decode.py)
# that calls them through block_matmul.h.
SOURCES = (CSRC / "block_matmul.c", CSRC / "decode_layer.c")
HEADERS = (CSRC / "block_matmul.h",)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    return Path(envs.get("ROOFLM_CACHE_DIR") or Path.home() / ".cache" / "rooflm")


def _build(sources: tuple[Path, ...], target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, f"-I{CSRC}", "-o", tmp, *map(str, sources)], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The built kernels, or None where they cannot run here (then torch's kernels are used)."""
    if not envs.get("ROOFLM_NATIVE_KERNELS"):
        return None
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        log.info("native CPU kernels off: the CPU lacks %s", ", ".join(missing))
        return None
    text = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"block_matmul-{digest}.so"
    try:
        if not target.exists():
            _build(SOURCES, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native CPU kernels unavailable (%s); using torch's", str(detail).strip()[:300])
        return None
    lib.rl_q4_linear.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _INT]
    lib.rl_q8_linear.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _INT]
    lib.rl_q4_linear.restype = lib.rl_q8_linear.restype = _INT
    # (shape, layers, x, T, positions, slots, tables, table widths, S, seq starts, seq rows, threads):
    # rooflm/quant/native_decode.py; slots, tables and widths: arrays per KV cache group
    lib.rl_decoder_forward.argtypes = [_P, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _INT]
    lib.rl_decoder_forward.restype = _INT
    return lib


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("native block matmul could not allocate its activation buffer")


def q4_linear(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, N] float32; codes [N, K/32, 16] uint8, fp16 scale/offset."""
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _check(lib.rl_q4_linear(x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), offset.data_ptr(),
                            n, y.data_ptr(), torch.get_num_threads()))
    return y


def q8_linear(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, N] float32; codes [N, K] int8, fp16 scale."""
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _check(lib.rl_q8_linear(x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), n, y.data_ptr(),
                            torch.get_num_threads()))
    return y
