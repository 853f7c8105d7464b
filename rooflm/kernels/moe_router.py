"""The mixture-of-experts router after its matmul, in one Triton launch: fp32 softmax over the
E logits, top-k, and the weights' renormalisation (or gpt-oss's softmax over the k chosen).

Why
---
torch spends five to eight launches a layer on it (the fp32 cast, softmax, topk's radix sort,
the sum and divide of norm_topk_prob); the H200 profile of Qwen3-30B-A3B's batch-1 decode put
the radix sort alone at 0.93 ms of a 7.82 ms step over 48 layers. A row of E <= 1024 logits
fits one program's registers, so the whole thing is one pass over the logits.

Algorithm (one program per token row, the row's E logits in registers, fp32)
---------
  scoring "softmax"       p = softmax(logits); the k largest p, in descending order;
                          renormalize: w = p_k / sum(p_k) (norm_topk_prob; Mixtral always)
  scoring "softmax_topk"  the k largest logits (the router's bias already added), in descending
                          order; w = softmax over those k (gpt-oss)
top-k is k rounds of (max, the lowest index holding it, mask it out): k <= 8 max-reductions
over E lanes, cheaper than any sort at these sizes.

Ties: an expert is chosen by its logit (softmax is monotonic, so that is p's order too), and
equal logits go lowest index first: the order of a stable descending sort (torch.sort(stable=
True)), and vLLM's topk_softmax's. torch.topk documents no order among ties, and does not keep
one (torch 2.13 on the CPU ranks three equal logits at experts 1, 3, 4 as 1, 4, 3), so the
tests check tied rows against the stable sort and the torch Router on rows without ties. The ids
equal the Router's wherever no two contenders' logits are equal or round to one fp32
probability; the weights match to fp32 rounding (exp and the sums' order).

Output: topk_weights fp32 [T, k], topk_ids int32 [T, k] (the fused MoE and moe_align read int32).

Work: FLOPs ~ E (exp) + k E (the rounds); bytes T E (logits) + 8 T k; a launch's latency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORINGS = {"softmax": 0, "softmax_topk": 1}
MAX_EXPERTS = 1024
MAX_TOP_K = 16


@triton.jit
def _router_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                   SCORING: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, E_PAD)
    valid = lanes < num_experts
    logits = tl.load(logits_ptr + row * stride_l + lanes, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        peak = tl.max(logits, axis=0)
        e = tl.where(valid, tl.exp(logits - peak), 0.0)
        probs = e / tl.sum(e, axis=0)

    ks = tl.arange(0, K_PAD)
    chosen_score = tl.zeros([K_PAD], dtype=tl.float32)
    chosen_id = tl.zeros([K_PAD], dtype=tl.int32)
    # avail: lanes still to choose from (a -inf logit stays choosable, once)
    avail = valid
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(avail, logits, float("-inf")), axis=0)
        idx = tl.min(tl.where((logits == best) & avail, lanes, E_PAD), axis=0)
        if SCORING == 0:
            score = tl.sum(tl.where(lanes == idx, probs, 0.0), axis=0)
        else:
            score = best
        chosen_score = tl.where(ks == i, score, chosen_score)
        chosen_id = tl.where(ks == i, idx, chosen_id)
        avail = avail & (lanes != idx)

    in_k = ks < TOP_K
    if SCORING == 1:  # softmax over the k chosen logits; the first is their max
        top = tl.max(tl.where(in_k, chosen_score, float("-inf")), axis=0)
        e = tl.where(in_k, tl.exp(chosen_score - top), 0.0)
        weights = e / tl.sum(e, axis=0)
    elif RENORMALIZE:
        weights = chosen_score / tl.sum(tl.where(in_k, chosen_score, 0.0), axis=0)
    else:
        weights = chosen_score
    tl.store(weights_ptr + row * TOP_K + ks, weights, mask=in_k)
    tl.store(ids_ptr + row * TOP_K + ks, chosen_id, mask=in_k)


def moe_router(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
               renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype; read as fp32) -> (topk_weights fp32 [T, k], topk_ids int32
    [T, k]) in one launch (module docstring). renormalize applies to scoring "softmax" only."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"router logits must be floating point, got {logits.dtype}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {sorted(SCORINGS)}, got {scoring!r}")
    num_tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"{num_experts} experts: the router kernel holds a row in one program (<= {MAX_EXPERTS})")
    if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"top_k {top_k} must be in [1, min(E={num_experts}, {MAX_TOP_K})]")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = max(16, triton.next_power_of_2(num_experts))
    _router_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0),
                                  TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), E_PAD=e_pad,
                                  SCORING=SCORINGS[scoring], RENORMALIZE=renormalize,
                                  num_warps=1 if e_pad <= 128 else 2 if e_pad <= 512 else 4)
    return weights, ids


def moe_router_ref(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                   renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's Router after its matmul, in torch: the definition the kernel is tested against."""
    logits = logits.float()
    if scoring == "softmax_topk":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
