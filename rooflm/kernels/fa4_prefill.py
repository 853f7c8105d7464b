"""Prefill attention on Hopper through FlashAttention-4's SM90 forward (the `flash-attn-4` package).

Why a second backend
--------------------
Triton 3.6 cannot express what the H100's fastest attention does: two consumer warpgroups whose
softmax runs while the other's matrix products do, fed by a producer warp through TMA and
mbarriers. rooflm's own prefill kernel (prefill_attention.py) stops at ~0.84x of cuDNN for that
reason. FlashAttention-4 (CuTe DSL, installed from the package index with `pip install
rooflm[hopper]`) has that SM90 kernel and reads rooflm's paged cache as it is: its page table is
our block table, its pages our blocks ([num_blocks, block_size, H_kv, D]). With 128-token blocks
a page is exactly one of its 128-key tiles and comes in by one TMA load; other block sizes go
through its gathered (non-TMA) path. H100, causal, H = 32/8, D = 128, same call
(benchmarks/results/fa4-prefill-h100-20261126/):

    TFLOP/s                  cuDNN   FA4 bs128   FA4 bs64   rooflm Triton bs64
    B=8  S=2048               498       504         453          407
    B=2  S=8192               560       614         540          490
    2048 queries over 16k      -        639         560          484

Semantics are rooflm's prefill (layers/attention.py, prefill_attention_ref): each sequence's
query_len queries are its last tokens, causal over its seq_len keys read through its block
table (FlashAttention aligns the causal mask to the bottom right, as a chunk over a cached
prefix needs). FLOPs and bytes are those of prefill_attention.py. One difference: a sequence's
last block is loaded whole and its keys past the end are masked, not skipped, so those slots
must hold finite values. The engine's do: the pool starts zeroed, and a reused block holds an
earlier sequence's K/V (a model that wrote NaN/Inf K/V could leak them into the next owner of
the block; rooflm's Triton kernels never load those slots).

Where it is used (TritonBackend.plan): the prefill sequences of a step on compute capability
9.x with a 16-bit cache (FA4's SM90 path has no FP8), no sliding window, not deterministic,
outside CUDA-graph capture (the spec loop's verify graphs keep the Triton kernel) and with at
least MIN_QUERY_LEN queries in some sequence (short verify spans gain nothing). Decodes keep
the split-KV Triton kernel. The package is optional: without it (or off Hopper) the Triton
kernel serves everything, and RuntimeConfig.prefill_attention chooses explicitly.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

import torch

from rooflm.config import PREFILL_ATTENTION_CHOICES

if TYPE_CHECKING:  # the paged-KV contract is the layers' (layers/attention.py); kernels read its fields
    from rooflm.layers.attention import AttentionMetadata

# Below this longest query span in a step, the Triton kernel (a 128-row FA4 tile is mostly idle).
MIN_QUERY_LEN = 64
# The KV block size the engine takes by default where this path runs: one TMA load a tile.
FA4_BLOCK_SIZE = 128


@lru_cache(maxsize=None)
def fa4_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and \
        importlib.util.find_spec("flash_attn.cute") is not None


def fa4_device(device: torch.device) -> bool:
    """Compute capability 9.x (the SM90 kernel; Blackwell has its own path in FA4, not wired here)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def fa4_enabled(choice: str, device: torch.device) -> bool:
    """Whether prefill goes through FA4 for RuntimeConfig.prefill_attention = choice; 'fa4' where
    it cannot run is an error that says why."""
    if choice not in PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION_CHOICES)}; got {choice!r}")
    if choice == "triton":
        return False
    ok = fa4_device(device) and fa4_installed()
    if choice == "fa4" and not ok:
        why = "needs a compute capability 9.x GPU" if not fa4_device(device) else \
            "needs the flash-attn-4 package (pip install 'rooflm[hopper]')"
        raise ValueError(f"prefill_attention=fa4 {why}")
    return ok


def fa4_block_size(config, device: torch.device) -> Optional[int]:
    """The CUDA default KV block size for an EngineConfig: FA4_BLOCK_SIZE where its prefill runs
    through FA4 (16-bit cache, the triton backend, not deterministic), else None (the usual)."""
    rt = config.runtime
    if rt.attention_backend == "reference" or rt.deterministic or config.cache.kv_cache_dtype != "auto":
        return None
    return FA4_BLOCK_SIZE if fa4_enabled(rt.prefill_attention, device) else None


def fa4_supports(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
                 sliding_window: Optional[int]) -> bool:
    """Whether this step's prefill sequences can go through FA4 (see the module docstring)."""
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and sliding_window is None and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and meta.max_query_len >= MIN_QUERY_LEN
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing()))


@dataclass
class FA4Plan:
    """FA4's view of the step's prefill sequences (the ones after the decodes), made once a step."""
    token_lo: int  # first prefill token in the packed batch
    token_hi: int  # one past the last
    cu_seqlens_q: torch.Tensor  # [n + 1] int32, from 0
    seqused_k: torch.Tensor  # [n] int32
    page_table: torch.Tensor  # [n, max_blocks] int32
    max_seqlen_q: int


def plan_fa4_prefill(meta: AttentionMetadata) -> FA4Plan:
    first = meta.num_decodes
    lo, hi = meta.query_start_loc_cpu[first], meta.query_start_loc_cpu[-1]
    cu = meta.query_start_loc[first:]
    cu = (cu - lo).to(torch.int32) if lo else cu.to(torch.int32)
    return FA4Plan(token_lo=lo, token_hi=hi, cu_seqlens_q=cu,
                   seqused_k=meta.seq_lens[first:].to(torch.int32),
                   page_table=meta.block_tables[first:].to(torch.int32).contiguous(),
                   max_seqlen_q=meta.max_query_len)


@lru_cache(maxsize=None)
def _fa4_forward():
    """FA4's forward entry point, imported once (the CuTe DSL takes seconds to import). Its
    compile step warns that an argument it never needs at run time (aux_data) is not a JIT
    argument, once a kernel; that one message is silenced."""
    warnings.filterwarnings("ignore", message="Argument aux_data", category=UserWarning)
    from flash_attn.cute.interface import _flash_attn_fwd
    return _flash_attn_fwd


def fa4_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                plan: FA4Plan, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of the prefill rows of q [T, H, D] into the same rows of out."""
    rows = slice(plan.token_lo, plan.token_hi)
    _fa4_forward()(q[rows], k_cache, v_cache, cu_seqlens_q=plan.cu_seqlens_q, seqused_k=plan.seqused_k,
                   max_seqlen_q=plan.max_seqlen_q, page_table=plan.page_table, softmax_scale=scale,
                   causal=True, out=out[rows])
    return out
