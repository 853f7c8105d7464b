"""LoRA tests: the Triton kernels run compiled on CUDA, under the interpreter on the CPU (set
before any kernel module is imported, as tests/kernels/conftest.py does)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
