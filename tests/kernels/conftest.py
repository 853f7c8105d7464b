"""Kernel tests: compiled on a CUDA machine, under Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before any kernel module is imported, so it is
set here, when pytest loads this directory, and only when there is no GPU.
Tests that only a GPU can run (bf16 tensor-core kernels, large shapes) are
marked `gpu`; tests/conftest.py skips them without CUDA. What the tests share
is in helpers.py.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def exact_fp32_references():
    """fp32 references in full fp32: an engine built by an earlier test (test_engine_triton.py)
    turns TF32 on for the whole process, and a TF32 reference misses the 1e-4 fp32 tolerance
    (seen on the H100: the D=256 fp32 prefill case failed in the suite, passed alone)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
