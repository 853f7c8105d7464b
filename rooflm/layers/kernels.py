"""The fused kernels a model is built with: chosen once by the model runner, passed down at
construction like the attention backend, never patched onto modules afterwards.

None means the layer's torch code (the CPU path and the reference). On CUDA the runner
passes the Triton kernels of rooflm/kernels/: RMSNorm with the residual add fused, SiLU-mul,
the one-token GEMV that runs a whole decoder layer as four weight reads, and the fused MoE.
With --deterministic (rooflm/deterministic/) the runner passes batch-invariant ones instead:
a linear kernel whose sums do not depend on the number of rows, and no GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Kernels:
    rmsnorm: Optional[Callable] = None  # (x, weight, eps, residual) -> y or (y, x + residual)
    silu_mul: Optional[Callable] = None  # [T, 2I] -> [T, I]
    gemv: Optional[Callable] = None  # rooflm.kernels.gemv.gemv, for one-token steps
    # (x, weight, bias, quant) -> y for every linear layer and the LM head; None: F.linear (or the
    # layer's quantized method). On CUDA: small_m_linear (batch-1 tiles for 2-16 rows where they
    # win); with --deterministic: a batch-invariant matmul.
    linear: Optional[Callable] = None
    # RMSNorm over each head of q and k ([T, H, D]; Qwen3); None: torch.
    head_norm: Optional[Callable] = None
    # The mixture-of-experts MLP, (x, w13, w2, topk_weights, topk_ids, **opts) -> [T, H]:
    # rooflm.kernels.fused_moe on CUDA; None: the experts loop of layers/moe.py.
    fused_moe: Optional[Callable] = None
    # The router after its matmul, (logits, top_k, scoring, renormalize) -> (weights fp32, ids
    # int32), one launch: rooflm.kernels.moe_router on CUDA; None: torch softmax + topk.
    moe_router: Optional[Callable] = None
    # The pairs' sort by expert for fused_moe, (topk_ids, block_m, num_experts) -> AlignedPairs;
    # None: fused_moe's choice by device and size (Triton's one launch for small batches on CUDA,
    # torch's past kernels/fused_moe.ALIGN_TRITON_MAX_PAIRS pairs).
    moe_align: Optional[Callable] = None


TORCH_KERNELS = Kernels()


def triton_kernels(decode_gemv: bool) -> Kernels:
    from rooflm.kernels.fused_moe import fused_moe
    from rooflm.kernels.gemv import gemv
    from rooflm.kernels.moe_router import moe_router
    from rooflm.kernels.rmsnorm import rmsnorm
    from rooflm.kernels.silu_mul import silu_mul
    from rooflm.kernels.small_m_linear import small_m_linear

    # head_norm: q/k norms over each head (Qwen3, Gemma 3) through the same row kernel as the
    # hidden-state norms, not torch's six element-wise launches a norm.
    return Kernels(rmsnorm=rmsnorm, silu_mul=silu_mul, gemv=gemv if decode_gemv else None, linear=small_m_linear,
                   fused_moe=fused_moe, moe_router=moe_router,
                   head_norm=rmsnorm)
