"""GPTQ: quantize a weight one input column at a time, pushing each column's rounding error onto
the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs
(Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1).

The layer's loss for a weight change dW is ||dW X||^2 = tr(dW H dW^T) with H = X X^T over the
calibration tokens. Rounding column k by err_k is compensated, exactly for this quadratic loss,
by subtracting err_k * Hinv[k, k+1:] / Hinv[k, k] from the later columns; with the upper Cholesky
factor of Hinv this is a row of a triangular matrix. Columns are processed in blocks of 128 so the
trailing update is one matmul per block (the "lazy batch" of the paper).

Group parameters (scale, zero) are chosen from the already-updated weights when each group starts,
as RTN would choose them (rtn.int4_params), so the format is the same as RTN's; only the codes
differ. The Hessian is whatever the caller collected: the float model's inputs, or with
sequential.py (`rooflm quantize --method gptq`'s default) those of the already quantized linears before it.
"""

from __future__ import annotations

from typing import Optional

import torch

from rooflm.quant.formats import ChannelWeight, GroupWeight
from rooflm.quant.rtn import int4_params, int4_params_mse

# GPTQ's diagonal damping, a fraction of the Hessian's mean diagonal (the paper's and AutoGPTQ's).
DEFAULT_DAMP = 0.01


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  damp: float = DEFAULT_DAMP, block: int = 128, scale_dtype: torch.dtype = torch.float16,
                  act_order: bool = False, mse: bool = False, refit: bool = False,
                  mse_rows: Optional[torch.Tensor] = None):
    """w [N, K], hessian [K, K] (sum of x x^T) -> GroupWeight (4-bit) or ChannelWeight (8-bit).

    act_order (GPTQ's desc_act, 4-bit): quantize the inputs with the largest Hessian diagonal
    first, while the most columns remain to absorb their error; groups are formed in that order,
    and the result carries the permutation (GPTQ's g_idx). mse: each group's range is searched
    for the smallest Hessian-weighted rounding error instead of taken as min..max; with mse_rows
    (bool [N]) only in those rows, the others keep min..max (range_search_rows). refit (4-bit):
    afterwards, the scales that minimise the layer's output error for the codes found
    (refit_group_scales). damp: added to H's diagonal before inversion, as a fraction of its mean
    diagonal (GPTQ's percdamp, AutoGPTQ's damp_percent; 0.01 in the paper and AutoGPTQ)."""
    if not damp > 0:
        raise ValueError(f"GPTQ damp must be > 0 (a fraction of the mean Hessian diagonal); got {damp}")
    W = w.detach().float().clone()
    n, k = W.shape
    H = hessian.detach().float().clone()
    dead = torch.diag(H) == 0  # inputs never seen: any value works; zero them
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if act_order and bits == 4:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    diag = torch.diag(H).clone()
    H += damp * torch.diag(H).mean() * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(n, k)
    if bits == 8:  # symmetric per channel: one scale for the row, fixed up front
        scale8 = (W.abs().amax(dim=1) / 127.0).clamp_min(1e-10).to(scale_dtype).float()
    else:
        groups = -(-k // group_size)
        scales = torch.zeros(n, groups)
        zeros = torch.zeros(n, groups)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()
        err1 = torch.zeros_like(W1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if bits == 8:
                s, z = scale8, 0.0
                q = torch.clamp(torch.round(W1[:, i] / s), -127, 127)
            else:
                if col % group_size == 0:
                    end = min(i + group_size, i2 - i1)
                    if mse:
                        s_g, z_g = int4_params_mse(W1[:, i:end], diag[col:col + end - i])
                        if mse_rows is not None:
                            s_m, z_m = int4_params(W1[:, i:end], end - i)
                            s_g = torch.where(mse_rows[:, None], s_g, s_m)
                            z_g = torch.where(mse_rows[:, None], z_g, z_m)
                    else:
                        s_g, z_g = int4_params(W1[:, i:end], end - i)
                    g = col // group_size
                    scales[:, g] = s_g[:, 0].to(scale_dtype).float()
                    zeros[:, g] = z_g[:, 0]
                g = col // group_size
                s, z = scales[:, g], zeros[:, g]
                q = torch.clamp(torch.round(W1[:, i] / s) + z, 0, 15)
            codes[:, col] = q
            dq = (q - z) * s
            err = (W1[:, i] - dq) / h1[i, i]
            W1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            err1[:, i] = err
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if bits == 8:
        return ChannelWeight(codes.to(torch.int8), scale8.to(scale_dtype), torch.zeros(n, dtype=scale_dtype), "int8")
    q = GroupWeight(codes.to(torch.uint8), scales.T.contiguous().to(scale_dtype),
                    zeros.T.contiguous().to(scale_dtype), group_size, perm, f"int4-g{group_size}")
    if refit:
        q = refit_group_scales(q, w, hessian, scale_dtype)
    return q


def asymmetric_target(w: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor, alpha: float,
                      damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """GPTQv2's asymmetric calibration (Li et al. 2025, "GPTQv2: Efficient Finetuning-Free
    Quantization with Asymmetric Calibration"; GPTQModel's `v2=True`): the weight GPTQ should
    quantize when the quantized layer, fed the quantized model's inputs X~, is to reproduce the
    float layer's output on the float model's inputs X.

    ||W X - Q X~||^2 = ||(W' - Q) X~||^2 + (a constant in Q), W' = W X X~^T H~^-1 = W + W dX X~^T H~^-1
    with H~ = X~ X~^T and dX = X - X~: W' is the least-squares fit of the float outputs from X~,
    and the remainder lies outside X~'s row space, so GPTQ on (W', H~) minimises the asymmetric
    loss exactly. Here w [N, K], hessian = H~ [K, K], cross = dX X~^T [K, K] (both sums over the
    calibration tokens), and W' = W + alpha W cross (H~ + damp)^-1. alpha < 1 shrinks the
    correction toward plain sequential GPTQ (alpha 0): the fit has K x K parameters from the
    calibration tokens (GPTQv2 and GPTQModel default to 0.25). The ridge is GPTQ's own damping."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"GPTQv2 alpha must be in [0, 1] (0: plain GPTQ, 1: the full least-squares target); "
                         f"got {alpha}")
    W = w.detach().float()
    H = hessian.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H += damp * torch.diag(H).mean() * torch.eye(H.shape[0])
    c = cross.detach().float().clone()
    c[:, dead] = 0.0
    # (W c) H^-1 = solve(H, (W c)^T)^T; H is symmetric positive definite.
    correction = torch.cholesky_solve((W @ c).T, torch.linalg.cholesky(H)).T
    return W + alpha * correction


def range_search_rows(linear, skip_qk: bool) -> Optional[torch.Tensor]:
    """The rows of `linear` whose group range GPTQ's `mse` may shrink: all (None) unless skip_qk,
    which keeps the q and k rows of a fused qkv_proj at their full min..max range.

    Why: a clipped q or k weight errs on the largest products of the attention scores, which
    the softmax then amplifies; AWQ's clip search skips q/k for this reason (llm-awq, AutoAWQ:
    "due to qk bmm, it is hard to clip precisely")."""
    shards = getattr(linear, "shard_offsets", {})
    if not skip_qk or "q" not in shards or "k" not in shards:
        return None
    rows = torch.ones(linear.out_features, dtype=torch.bool)
    for shard in ("q", "k"):
        offset, size = shards[shard]
        rows[offset:offset + size] = False
    return rows


def group_output_error(q: GroupWeight, w: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Per output row, tr(dW H dW^T)'s row term for dW = q.dequantize() - w [N]."""
    dw = q.dequantize() - w.float()
    return ((dw @ hessian.float()) * dw).sum(dim=1)


def refit_group_scales(q: GroupWeight, w: torch.Tensor, hessian: torch.Tensor,
                       scale_dtype: torch.dtype = torch.float16) -> GroupWeight:
    """Keep q's codes and (integer) zero points; replace each row's group scales by those that
    minimise its output error (W_q - W) H (W_q - W)^T, W_q[i] = (code_i - zero_g) * s_g.

    Why: GPTQ fixes each group's scale from the weights when the group starts (before the later
    columns' compensation lands), then rounds every code for that scale; the scales are the only
    continuous parameters of the format left, and given the codes the loss is quadratic in them:
    per row, a G x G least squares (M s = r, M[g, h] = sum_{i in g, j in h} a_i H_ij a_j,
    r[g] = sum_{i in g} a_i (H w)_i, a_i = code_i - zero_g), G = K / group_size. A row keeps its old
    scales wherever the new ones (rounded to the stored dtype) are not better or not positive."""
    W = w.detach().float()
    H = hessian.detach().float()
    if q.perm is not None:  # codes are in act-order (q.perm) order
        W = W[:, q.perm]
        H = H[q.perm][:, q.perm]
    n, k = W.shape
    gs = q.group_size
    groups = -(-k // gs)
    pad = groups * gs - k
    zeros = q.zeros.float().T.repeat_interleave(gs, dim=1)[:, :k]
    a = torch.nn.functional.pad(q.codes.float() - zeros, (0, pad))  # [N, G*gs]
    hp = torch.nn.functional.pad(H, (0, pad, 0, pad))
    m = torch.empty(n, groups, groups)
    for g in range(groups):  # row-block g of M for every row at once: [N, gs] @ [gs, K]
        t = a[:, g * gs:(g + 1) * gs] @ hp[g * gs:(g + 1) * gs]
        m[:, g, :] = (t * a).reshape(n, groups, gs).sum(dim=2)
    r = (a * torch.nn.functional.pad(W @ H, (0, pad))).reshape(n, groups, gs).sum(dim=2)
    ridge = 1e-6 * torch.diagonal(m, dim1=1, dim2=2).mean(dim=1).clamp_min(1e-12)
    m = m + ridge[:, None, None] * torch.eye(groups)
    s_new = torch.linalg.solve(m, r[:, :, None])[:, :, 0].to(scale_dtype).float()  # [N, G]
    ok = torch.isfinite(s_new).all(dim=1) & (s_new > 0).all(dim=1)
    s_new = torch.where(ok[:, None], s_new, q.scales.float().T)
    candidate = GroupWeight(q.codes, s_new.T.contiguous().to(scale_dtype), q.zeros, gs, q.perm, q.format)
    better = group_output_error(candidate, w, hessian) < group_output_error(q, w, hessian)
    scales = torch.where(better[None, :], candidate.scales, q.scales)
    return GroupWeight(q.codes, scales.contiguous(), q.zeros, gs, q.perm, q.format)
