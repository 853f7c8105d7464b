"""AWQ: activation-aware weight scaling before quantization (Lin et al. 2023, "AWQ: Activation-aware
Weight Quantization for LLM Compression and Acceleration", Sec. 3.2; llm-awq's auto_scale / auto_clip).

A linear y = W x is unchanged by y = (W diag(s)) (diag(1/s) x) for any positive per-input-channel
s. Multiplying the input channels that carry large activations by s > 1 before rounding W shrinks
their relative rounding error, at the price of the other channels of the same group. AWQ takes
s = mean|x|^alpha (normalised so that max(s) * min(s) = 1) and picks alpha per linear group on a
grid, minimising the layer's output error on calibration inputs (AutoAWQ's duo scaling,
s = mean|x|^alpha / mean|w|^(1-alpha), is searched too with `duo_scaling`).

The output error of a weight change dW on inputs X is ||dW X^T||^2 = tr(dW H dW^T), H = X^T X: the
same Hessian GPTQ collects (quantize.collect_hessians). So the search needs no stored activations,
and it scores every calibration token. With the scale folded in, the quantized weight acts as
Q(W diag(s)) diag(1/s), and its error is dW = Q(W diag(s)) / s - W. alpha = 0 (s = 1) is plain RTN
and is on the grid, so the search never does worse than RTN on this loss.

The 1/s goes where it costs nothing at run time, so the fold is exact in float (a test checks it):
  qkv_proj      input is input_layernorm's output: RMSNorm weight / s
  gate_up_proj  input is post_attention_layernorm's output: RMSNorm weight / s
  down_proj     input is silu(gate) * up: the up rows of gate_up_proj / s
  o_proj        input is the attention output, each channel a linear mix of v's channel of the same
                kv head: the v rows of qkv_proj / s. Under GQA one v channel feeds the G query
                heads of its group, so o_proj's scales are tied across them (mean|x| averaged).
Every Llama-family model rooflm runs has these four seams, so no explicit scale tensor is needed.

Clipping (`clip`, llm-awq's auto_clip): after scaling, each (row, group)'s min-max range may be
shrunk; the factor is chosen per row and group for the smallest error dW_g H_gg dW_g^T, with H_gg
the group's diagonal block of H (cross-group terms ignored, as llm-awq's per-group search does).
It applies to the RTN path; `awq+gptq` quantizes the scaled weights with GPTQ (whose Hessian of
the scaled inputs is diag(1/s) H diag(1/s): no second calibration pass), and by default scores
each alpha with GPTQ itself (`score_with`): RTN's error is a poor guide to what GPTQ will leave.

This scores each linear's own output, the same objective GPTQ uses; awq_block.py scores qkv_proj
and gate_up_proj on the output of their whole block as llm-awq does (`--awq-objective block`), and
awq_sequential.py does that on the quantized model's own inputs (`--awq-inputs quantized`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rooflm.quant.formats import GroupWeight
from rooflm.quantize.gptq import DEFAULT_DAMP, range_search_rows
from rooflm.quant.rtn import WeightScheme, int4_params, quantize_int4_codes, quantize_weight


@dataclass(frozen=True)
class AwqConfig:
    scheme: WeightScheme
    # llm-awq's n_grid = 20: alpha in 0, 0.05, ..., 0.95.
    alphas: tuple[float, ...] = tuple(i / 20 for i in range(20))
    # Also search AutoAWQ's "duo" scales s = mean|x|^alpha / mean|w|^(1 - alpha) (its default),
    # which damp channels whose weights are already large; the better of the two forms is kept.
    # Off by default: on SmolLM2 g128 AWQ+GPTQ it lowered the summed per-linear error (0.701x RTN
    # vs 0.713x) but gave +8.00% perplexity against +7.67% (benchmarks/results/quant-cpu-20261125/).
    duo_scaling: bool = False
    # How each alpha's quantized weight is made while scoring it: "rtn" (llm-awq) or "gptq" (the
    # quantizer `awq+gptq` will use, with gptq_act_order / gptq_mse: the search then scores the
    # combination that is written). On SmolLM2 g128 AWQ+GPTQ, RTN scoring gave +7.67% perplexity
    # and GPTQ scoring +5.37%, in about the same time on one thread (the CLI's awq+gptq default);
    # at g32 it went the other way, +3.13% vs +3.85% (benchmarks/results/quant-cpu-20261125/).
    score_with: str = "rtn"
    gptq_act_order: bool = False
    gptq_mse: bool = False
    gptq_refit: bool = False
    gptq_mse_skip_qk: bool = False  # GPTQ keeps q/k rows' full range (gptq.range_search_rows)
    gptq_damp: float = DEFAULT_DAMP  # GPTQ's diagonal damping (gptq_quantize's damp, the CLI's --damp)

    def quantizer(self, mse_rows: Optional[torch.Tensor] = None):
        """(scaled w [N, K], Hessian of the scaled inputs) -> dequantized weight, for scoring;
        mse_rows: gptq_quantize's (the rows whose range GPTQ's mse may shrink)."""
        if self.score_with == "rtn":
            return lambda w, h: fake_quantize(w, self.scheme)
        if self.score_with == "gptq":
            from rooflm.quantize.gptq import gptq_quantize
            return lambda w, h: gptq_quantize(w, h, self.scheme.bits, self.scheme.group_size, scale_dtype=torch.float32,
                                              act_order=self.gptq_act_order, mse=self.gptq_mse,
                                              refit=self.gptq_refit, mse_rows=mse_rows,
                                              damp=self.gptq_damp).dequantize()
        raise ValueError(f"AWQ score_with must be 'rtn' or 'gptq'; got {self.score_with!r}")
    # Range shrink factors of the clip search (llm-awq: max_shrink 0.5 in 20 steps; here fewer,
    # the same spacing near 1 where the choices fall).
    shrinks: tuple[float, ...] = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)


@dataclass
class AwqReport:
    """The alpha chosen per linear and the output error it brought, relative to the unscaled
    weight's (alpha 0) under the scoring quantizer (RTN or GPTQ)."""

    alpha: dict[str, float] = field(default_factory=dict)
    error_ratio: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.alpha:
            return "AWQ: no linears scaled"
        ratios = list(self.error_ratio.values())
        mean_alpha = sum(self.alpha.values()) / len(self.alpha)
        return (f"AWQ: {len(self.alpha)} linear groups, mean alpha {mean_alpha:.2f}, output error vs alpha 0 "
                f"(unscaled) mean {sum(ratios) / len(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


def fake_quantize(w: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """RTN quantize-dequantize of w [N, K] in fp32 (scales kept in fp32: the search compares
    alphas, and the fp16 rounding of scales is the same for all)."""
    if scheme.bits == 8:
        return quantize_weight(w, scheme, torch.float32).dequantize()
    scale, zero = int4_params(w, scheme.group_size)
    codes = quantize_int4_codes(w, scale, zero, scheme.group_size)
    k = w.shape[1]
    s = scale.repeat_interleave(scheme.group_size, dim=1)[:, :k]
    z = zero.repeat_interleave(scheme.group_size, dim=1)[:, :k]
    return (codes - z) * s


def output_error(dw: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(dW H dW^T): the summed squared output error over the calibration tokens."""
    return float(((dw @ hessian) * dw).sum())


def search_scale(w: torch.Tensor, hessian: torch.Tensor, act_mean: torch.Tensor, config: AwqConfig,
                 tie: Optional[tuple[int, int, int]] = None,
                 error: Optional[Callable[[torch.Tensor], float]] = None,
                 mse_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, float, float]:
    """(s [K], alpha, error / RTN's error) for w [N, K] whose inputs have mean |x| act_mean [K].

    tie (kv_heads, group, head_dim): the inputs are [query head, head_dim] and channels of the
    query heads of one kv group must share their scale (o_proj under GQA).
    error: the objective of a candidate, given its effective weight Q(W diag(s)) diag(1/s) [N, K];
    default this linear's own output error tr(dW H dW^T) (awq_block.py passes a block's output error)."""
    w = w.float()
    h = hessian.float()
    mean = act_mean.float().clamp_min(1e-8)
    w_mean = weight_magnitude(w, config.scheme)
    if tie is not None:
        kv_heads, group, head_dim = tie

        def tied(v):
            return v.reshape(kv_heads, group, head_dim).mean(dim=1, keepdim=True).expand(-1, group, -1).reshape(-1)
        mean, w_mean = tied(mean), tied(w_mean)
    best = (torch.ones_like(mean), 0.0, None)
    base = None
    quantize = config.quantizer(mse_rows)
    for duo in ((False, True) if config.duo_scaling else (False,)):
        for alpha in config.alphas:
            s = mean.pow(alpha)
            if duo:
                s = (s / (w_mean.pow(1 - alpha) + 1e-4)).clamp_min(1e-4)
            s = s / (s.max() * s.min()).sqrt()  # llm-awq's normalisation: the scales centre on 1
            wq = quantize(w * s[None, :], h / (s[:, None] * s[None, :])) / s[None, :]
            err = output_error(wq - w, h) if error is None else error(wq)
            if base is None:
                base = err  # alpha 0 without duo: s = 1, RTN
            if best[2] is None or err < best[2]:
                best = (s, alpha, err)
    ratio = best[2] / base if base else 1.0
    return best[0], best[1], ratio


def weight_magnitude(w: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """AutoAWQ's per-input-channel weight scale: |w| relative to its (row, group)'s largest,
    averaged over the rows [K]."""
    n, k = w.shape
    g = k if scheme.group_size <= 0 else scheme.group_size
    padded = torch.nn.functional.pad(w.abs(), (0, -k % g)).reshape(n, -1, g)
    rel = padded / padded.amax(dim=2, keepdim=True).clamp_min(1e-8)
    return rel.reshape(n, -1)[:, :k].mean(dim=0).clamp_min(1e-8)


def clipped_rtn_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int, shrinks: tuple[float, ...],
                     scale_dtype: torch.dtype = torch.float16) -> GroupWeight:
    """RTN int4 with each (row, group)'s range shrunk by the factor (of `shrinks`) that minimises
    the group's output error dW_g H_gg dW_g^T (llm-awq's auto_clip, scored with the Hessian)."""
    w = w.float()
    n, k = w.shape
    groups = -(-k // group_size)
    scales = torch.zeros(n, groups)
    zeros = torch.zeros(n, groups)
    for g in range(groups):
        lo_k, hi_k = g * group_size, min((g + 1) * group_size, k)
        wg = w[:, lo_k:hi_k]
        hg = hessian[lo_k:hi_k, lo_k:hi_k].float()
        best_err = torch.full((n,), float("inf"))
        for p in shrinks:
            lo = (wg.amin(dim=1) * p).clamp(max=0.0)
            hi = (wg.amax(dim=1) * p).clamp(min=0.0)
            # The stored (fp16) scale, as rtn_int4 does: the codes are chosen for what is stored.
            scale = ((hi - lo) / 15.0).clamp_min(1e-10).to(scale_dtype).float()
            zero = torch.round(-lo / scale).clamp(1, 15)
            q = torch.clamp(torch.round(wg / scale[:, None]) + zero[:, None], 0, 15)
            dw = (q - zero[:, None]) * scale[:, None] - wg
            err = ((dw @ hg) * dw).sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            scales[:, g] = torch.where(better, scale, scales[:, g])
            zeros[:, g] = torch.where(better, zero, zeros[:, g])
    codes = quantize_int4_codes(w, scales, zeros, group_size)
    return GroupWeight(codes.to(torch.uint8), scales.T.contiguous().to(scale_dtype),
                       zeros.T.contiguous().to(scale_dtype), group_size, None, f"int4-g{group_size}")


def _layer_groups(model, index: int):
    """(linear name, linear, tie) for the four scaled linears of decoder layer `index`."""
    layer = model.model.layers[index]
    prefix = f"model.layers.{index}"
    attn, mlp = layer.self_attn, layer.mlp
    q_size = attn.o_proj.in_features
    kv_size = attn.qkv_proj.shard_offsets["v"][1]
    head_dim = _head_dim(attn)
    kv_heads = kv_size // head_dim
    tie = (kv_heads, q_size // kv_size, head_dim)
    return [(f"{prefix}.self_attn.qkv_proj", attn.qkv_proj, None),
            (f"{prefix}.self_attn.o_proj", attn.o_proj, tie),
            (f"{prefix}.mlp.gate_up_proj", mlp.gate_up_proj, None),
            (f"{prefix}.mlp.down_proj", mlp.down_proj, None)]


def _head_dim(attn) -> int:
    return int(attn.cfg.head_dim)


def _fold_into_norm(norm, linear, s: torch.Tensor) -> None:
    """The RMSNorm before a linear takes 1/s, the linear's input columns take s."""
    norm.weight.div_(s.to(norm.weight.dtype))
    linear.weight.mul_(s[None, :].to(linear.weight.dtype))


@torch.no_grad()
def fold_scales(model, index: int, scales: dict[str, torch.Tensor]) -> None:
    """Multiply each linear's input columns by its s and divide the seam before it by s
    (see the module docstring); the float model's outputs do not change."""
    layer = model.model.layers[index]
    attn, mlp = layer.self_attn, layer.mlp
    prefix = f"model.layers.{index}"
    s = scales.get(f"{prefix}.self_attn.qkv_proj")
    if s is not None:
        _fold_into_norm(layer.input_layernorm, attn.qkv_proj, s)
    s = scales.get(f"{prefix}.self_attn.o_proj")
    if s is not None:
        offset, size = attn.qkv_proj.shard_offsets["v"]
        q_size = attn.o_proj.in_features
        head_dim = _head_dim(attn)
        group = q_size // size
        # The scale of v channel (kv head j, d) is the (tied) scale of query head j * G + i, d.
        s_v = s.reshape(size // head_dim, group, head_dim)[:, 0, :].reshape(-1)
        attn.qkv_proj.weight[offset:offset + size].div_(s_v[:, None].to(attn.qkv_proj.weight.dtype))
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias[offset:offset + size].div_(s_v.to(attn.qkv_proj.bias.dtype))
        attn.o_proj.weight.mul_(s[None, :].to(attn.o_proj.weight.dtype))
    s = scales.get(f"{prefix}.mlp.gate_up_proj")
    if s is not None:
        _fold_into_norm(layer.post_attention_layernorm, mlp.gate_up_proj, s)
    s = scales.get(f"{prefix}.mlp.down_proj")
    if s is not None:
        offset, size = mlp.gate_up_proj.shard_offsets["up"]
        mlp.gate_up_proj.weight[offset:offset + size].div_(s[:, None].to(mlp.gate_up_proj.weight.dtype))
        mlp.down_proj.weight.mul_(s[None, :].to(mlp.down_proj.weight.dtype))


@torch.no_grad()
def apply_awq(model, hessians: dict[str, torch.Tensor], act_means: dict[str, torch.Tensor],
              config: AwqConfig) -> AwqReport:
    """Search and fold AWQ scales into every decoder layer of a float model, in place; rescale
    `hessians` to the scaled inputs (H / (s s^T)) so GPTQ can follow without re-calibrating."""
    from rooflm.quantize.progress import progress_bar

    report = AwqReport()
    bar = progress_bar(len(model.model.layers), "AWQ scale search", unit="layer")
    for index in range(len(model.model.layers)):
        scales = {}
        for name, linear, tie in _layer_groups(model, index):
            if linear.quant is not None or linear.weight.numel() == 0:
                raise ValueError(f"AWQ needs float weights; {name} is already quantized")
            s, alpha, ratio = search_scale(linear.weight, hessians[name], act_means[name], config, tie,
                                           mse_rows=range_search_rows(linear, config.gptq_mse_skip_qk))
            scales[name] = s
            report.alpha[name] = alpha
            report.error_ratio[name] = ratio
        fold_scales(model, index, scales)
        for name, s in scales.items():
            hessians[name] = hessians[name] / (s[:, None] * s[None, :])
        bar.update(1)
    bar.close()
    return report
