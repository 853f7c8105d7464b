"""Hand-written CUDA kernels (csrc/*.cu): compiled at run time by NVRTC, launched through the driver.

torch.cuda._compile_kernel (a private torch API, in torch 2.11 and 2.13) compiles a source string
with NVRTC: no nvcc and no C++ toolchain on the serving machine. cuLaunchKernelEx (through ctypes)
launches on the current stream, so CUDA graphs capture the launch, and may add the programmatic
stream serialization attribute (PDL: the kernel starts while the one before drains and waits with
griddepcontrol.wait before it reads that kernel's results).
"""

from __future__ import annotations

import ctypes
import functools
import re
import struct
from pathlib import Path
from typing import Sequence, Union

import torch

CSRC = Path(__file__).with_name("csrc")
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_PDL_ATTRIBUTE = 6
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    """The CUDA driver library, loaded once: torch.cuda._utils opens a new CDLL on every call (a
    dlopen and fresh symbol lookups, tens of us a launch in an eager step)."""
    return torch.cuda._utils._get_gpu_runtime_library()


@functools.lru_cache(maxsize=None)
def _launch_fn():
    return _driver().cuLaunchKernelEx


def available(device_index: int, major: int = 8) -> bool:
    """NVRTC at hand (the private torch API) and a device of compute capability >= major."""
    return hasattr(torch.cuda, "_compile_kernel") and torch.cuda.get_device_capability(device_index)[0] >= major


_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def source_text(source: str) -> str:
    """csrc/<source> with its local #include "x.cuh" lines replaced by csrc/x.cuh (NVRTC gets one
    string and no include path); nvcc reads the same file with the includes as they are."""
    return _INCLUDE.sub(lambda m: (CSRC / m.group(1)).read_text(), (CSRC / source).read_text())


def compile_kernel(source: str, name: str, defines: dict, device_index: int, dynamic_smem: int = 0):
    """csrc/<source> compiled with -D<key>=<value> for each define; dynamic_smem above 48 KB is
    requested from the driver (a launch above 48 KB fails otherwise)."""
    options = [f"-D{key}={int(value)}" for key, value in defines.items()] + ["-std=c++17"]
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(source_text(source), name, nvcc_options=options)
    if dynamic_smem > 48 * 1024:
        status = _driver().cuFuncSetAttribute(
            kernel.func, _MAX_DYNAMIC_SHARED, ctypes.c_int(dynamic_smem))
        if status != 0:
            raise RuntimeError(f"{name}: {dynamic_smem} bytes of shared memory refused (CUresult {status})")
    return kernel


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _arg(a):
    """A kernel argument as struct.pack takes it: (format, value)."""
    if isinstance(a, torch.Tensor):
        return "P", a.data_ptr()
    if isinstance(a, float):
        return "f", a
    return "i", int(a)


def pack_args(args: list) -> bytes:
    """The kernel's parameters as one buffer laid out as C lays out a struct of them (native
    alignment: pointers on 8 bytes, fp32 and int32 on 4), which cuLaunchKernelEx takes through its
    `extra` argument (CU_LAUNCH_PARAM_BUFFER_POINTER): one struct.pack instead of a ctypes object
    and a pointer to it per argument."""
    formats, values = zip(*(_arg(a) for a in args))
    return struct.pack("@" + "".join(formats), *values)


_BUFFER_POINTER, _BUFFER_SIZE, _PARAMS_END = 1, 2, 0  # CU_LAUNCH_PARAM_* (cuda.h)
# The one launch attribute, read by the driver at launch: programmatic stream serialization on.
_PDL_ON = ctypes.pointer(_LaunchAttribute(id=_PDL_ATTRIBUTE, value=(1).to_bytes(4, "little") + bytes(60)))


def launch(kernel, grid: Union[int, Sequence[int]], block: int, smem: int, args: list, pdl: bool) -> None:
    """cuLaunchKernelEx on the current stream (capturable). args: tensors (their pointers), Python
    floats (fp32) and ints (int32), in the kernel's order."""
    grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
    packed = pack_args(args)
    buffer = ctypes.create_string_buffer(packed, len(packed))
    size = ctypes.c_size_t(len(packed))
    extra = (ctypes.c_void_p * 5)(_BUFFER_POINTER, ctypes.addressof(buffer), _BUFFER_SIZE, ctypes.addressof(size),
                                  _PARAMS_END)
    cfg = _LaunchConfig(grid, (block, 1, 1), smem, torch.cuda.current_stream().cuda_stream,
                        _PDL_ON, 1 if pdl else 0)
    status = _launch_fn()(ctypes.byref(cfg), kernel.func, None, extra)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
