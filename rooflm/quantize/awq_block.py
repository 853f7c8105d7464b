"""AWQ scales chosen by the error of the whole block's output (llm-awq's auto_scale objective):
the attention block's output for the qkv_proj scales, the MLP's output for the gate_up_proj
scales; o_proj and down_proj keep their own output error (awq.py's Hessian objective), as in
llm-awq, where their "block" is the linear itself.

Why: a linear's own output error weighs every output channel alike, but the block does not. The
attention softmax makes q and k errors matter through the scores they move (a large error on a
channel with small scores costs little), and SiLU(gate) * up makes gate errors matter where up is
large. awq.py's per-linear objective, scored with RTN or GPTQ, did not reliably order scale
choices whose perplexities differ by a point on SmolLM2 (benchmarks/results/quant-cpu-20261125/).

How, per decoder layer:
1. o_proj's and down_proj's scales are searched first (per-linear, awq.py) and folded into the v
   and up rows; then o_proj and down_proj are quantized with the scoring quantizer, as they will
   be written (so the block's output error of a qkv / gate_up choice is the one the checkpoint
   will carry, o_proj's / down_proj's own rounding included);
2. each alpha of qkv_proj (gate_up_proj) is scored by running the attention (MLP) block on the
   float model's block inputs of a few calibration windows, with the candidate's effective weight
   Q(W diag(s)) diag(1/s) and the quantized o_proj (down_proj), against the float block's output;
3. the chosen scales fold into the RMSNorms as in awq.py, and the Hessians are rescaled for GPTQ.

The block forwards here are plain torch (per window: RoPE, causal attention with GQA) so the
search can run a block many times without the engine; a test checks they reproduce what the
engine computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rooflm.quantize.awq import AwqConfig, AwqReport, _layer_groups, fold_scales, search_scale
from rooflm.quantize.gptq import range_search_rows


@dataclass(frozen=True)
class BlockInputs:
    """Per calibration window, the float model's input of one layer's attention block (qkv_proj's
    input: input_layernorm's output) and MLP block (gate_up_proj's input), [T, hidden] each."""

    attention: tuple[torch.Tensor, ...]
    mlp: tuple[torch.Tensor, ...]


@torch.no_grad()
def capture_block_inputs(llm, windows: list[list[int]]) -> list[BlockInputs]:
    """Run each window alone through the float model (one request, positions 0..T-1) and keep
    every layer's block inputs; a chunked prefill's pieces are joined in order."""
    from rooflm.sampling_params import SamplingParams
    model = llm.engine.model
    layers = model.model.layers
    seen: dict[tuple[int, str], list[torch.Tensor]] = {}
    handles = []
    for index, layer in enumerate(layers):
        for kind, linear in (("attention", layer.self_attn.qkv_proj), ("mlp", layer.mlp.gate_up_proj)):
            def hook(mod, args, key=(index, kind)):
                seen.setdefault(key, []).append(args[0].reshape(-1, mod.in_features).float().clone())
            handles.append(linear.register_forward_pre_hook(hook))
    per_window: list[dict] = []
    try:
        for window in windows:
            seen.clear()
            llm.generate([window], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            joined = {key: torch.cat(parts) for key, parts in seen.items()}
            for key, x in joined.items():
                if x.shape[0] != len(window):
                    raise RuntimeError(f"AWQ block inputs: layer {key[0]} {key[1]} saw {x.shape[0]} tokens for a "
                                       f"window of {len(window)}")
            per_window.append(joined)
    finally:
        for h in handles:
            h.remove()
    return [BlockInputs(tuple(w[(i, "attention")] for w in per_window), tuple(w[(i, "mlp")] for w in per_window))
            for i in range(len(layers))]


def attention_block(attn, x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """The attention block's output [T, hidden] for one window x [T, hidden] at positions 0..T-1,
    with the given fused q/k/v weight and o_proj weight (bias and q/k norms from `attn`)."""
    t = x.shape[0]
    heads, head_dim = attn.heads, attn.cfg.head_dim
    window = attn.attn.sliding_window
    if window is not None and window < t:
        raise ValueError(f"AWQ block objective: sliding window {window} < calibration window {t} is not "
                         f"supported; use the per-linear objective (--awq-objective linear)")
    qkv = F.linear(x, w_qkv, attn.qkv_proj.bias)
    q_size, kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(t, heads.num_heads, head_dim)
    k = k.reshape(t, heads.num_kv_heads, head_dim)
    v = v.reshape(t, heads.num_kv_heads, head_dim)
    if attn.cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.attn.rotary(torch.arange(t), q, k)
    group = heads.num_heads // heads.num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=attn.attn.scale)
    return F.linear(out.transpose(0, 1).reshape(t, q_size), w_o, attn.o_proj.bias)


def mlp_block(mlp, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The gated MLP's output down(silu(gate x) * up x) [T, hidden] with the given weights."""
    gate_up = F.linear(x, w_gate_up, mlp.gate_up_proj.bias)
    _, gate_size = mlp.gate_up_proj.shard_offsets["gate"]
    gate, up = gate_up.split([gate_size, gate_up.shape[-1] - gate_size], dim=-1)
    return F.linear(F.silu(gate) * up, w_down, mlp.down_proj.bias)


def _block_error(block, inputs: tuple[torch.Tensor, ...], w_first: torch.Tensor, w_second: torch.Tensor,
                 w_second_quantized: torch.Tensor):
    """The objective of a candidate first-linear weight: the summed squared error of the block's
    output over the windows, with the quantized second linear, against the float block's."""
    references = [block(x, w_first, w_second) for x in inputs]

    def error(w_candidate: torch.Tensor) -> float:
        return float(sum(((block(x, w_candidate, w_second_quantized) - ref) ** 2).sum()
                         for x, ref in zip(inputs, references)))
    return error


@torch.no_grad()
def apply_awq_block(model, hessians: dict[str, torch.Tensor], act_means: dict[str, torch.Tensor],
                    inputs: list[BlockInputs], config: AwqConfig) -> AwqReport:
    """awq.apply_awq with the block-output objective for qkv_proj and gate_up_proj (module
    docstring); folds the scales into the float model and rescales `hessians`, in place.
    The report's error ratio of qkv/gate_up is the block output error against alpha 0's."""
    report = AwqReport()
    quantize = config.quantizer()
    for index, layer in enumerate(model.model.layers):
        groups = {name: (linear, tie) for name, linear, tie in _layer_groups(model, index)}
        for name, (linear, _) in groups.items():
            if linear.quant is not None or linear.weight.numel() == 0:
                raise ValueError(f"AWQ needs float weights; {name} is already quantized")
        prefix = f"model.layers.{index}"
        qkv, o, gate_up, down = (f"{prefix}.self_attn.qkv_proj", f"{prefix}.self_attn.o_proj",
                                 f"{prefix}.mlp.gate_up_proj", f"{prefix}.mlp.down_proj")
        # 1. The second linear of each block by its own output, folded now: the first linear's
        # search then sees the v / up rows it will be written with.
        second = {}
        for name in (o, down):
            linear, tie = groups[name]
            s, alpha, ratio = search_scale(linear.weight, hessians[name], act_means[name], config, tie)
            second[name] = s
            report.alpha[name], report.error_ratio[name] = alpha, ratio
        fold_scales(model, index, second)
        for name, s in second.items():
            hessians[name] = hessians[name] / (s[:, None] * s[None, :])
        # 2. The first linear of each block by the block's output, the second quantized as written.
        first = {}
        attn, mlp = layer.self_attn, layer.mlp
        for name, block, x, follower in ((qkv, lambda x, a, b: attention_block(attn, x, a, b), inputs[index].attention, o),
                                         (gate_up, lambda x, a, b: mlp_block(mlp, x, a, b), inputs[index].mlp, down)):
            linear = groups[name][0]
            w_follower = groups[follower][0].weight.float()
            follower_q = quantize(w_follower, hessians[follower])
            error = _block_error(block, x, linear.weight.float(), w_follower, follower_q)
            s, alpha, ratio = search_scale(linear.weight, hessians[name], act_means[name], config, None, error,
                                           range_search_rows(linear, config.gptq_mse_skip_qk))
            first[name] = s
            report.alpha[name], report.error_ratio[name] = alpha, ratio
        fold_scales(model, index, first)
        for name, s in first.items():
            hessians[name] = hessians[name] / (s[:, None] * s[None, :])
    return report
