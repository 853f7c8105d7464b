"""AWQ + GPTQ layer by layer on the quantized model's own inputs: each layer's qkv_proj and
gate_up_proj scales are searched (block-output objective, awq_block.py) on the inputs that the
already scaled and quantized layers before it produce, then the layer is quantized with GPTQ on
those same inputs (sequential.py's order).

Why: awq_block.py searches every layer's scales on the float model's block inputs, but the
checkpoint feeds layer i the quantized layers 0..i-1's outputs; the scales protect the channels
that are large in the float model's activations, not necessarily in the quantized model's.

How, in one calibration prefill (all windows in one step, as sequential.py), with a pre-hook on
each decoder linear, which fire in execution order:
- qkv_proj of layer i: o_proj's scale is searched per-linear on the float model's statistics
  (o_proj's inputs depend on the quantized qkv, which does not exist yet) and folded into the v
  rows; o_proj, scaled, is quantized with the scoring quantizer on its float Hessian to stand for
  the o_proj that will be written. qkv_proj's scale is then searched on the attention block's
  output for the first windows of the input it is handed, folded into input_layernorm, and the
  hook hands qkv_proj x / s (what the folded norm would have produced). qkv_proj is quantized with
  GPTQ on the Hessian of x / s and its dequantized weight written back before it runs.
- o_proj: GPTQ on its input (the attention of the quantized q/k/v), as sequential.py.
- gate_up_proj / down_proj: the same as qkv_proj / o_proj, with the MLP block and the up rows.
"""

from __future__ import annotations

import torch

from rooflm.quantize.awq import AwqConfig, AwqReport, _layer_groups, fold_scales, search_scale
from rooflm.quantize.awq_block import _block_error, attention_block, mlp_block
from rooflm.quantize.gptq import range_search_rows
from rooflm.quantize.sequential import check_one_step


def sequential_awq_gptq(llm, windows: list[list[int]], config: AwqConfig, float_hessians: dict[str, torch.Tensor],
                        float_act_means: dict[str, torch.Tensor], block_windows: int, act_order: bool = False,
                        mse: bool = False, refit: bool = False) -> tuple[dict, AwqReport]:
    """Scale and quantize every decoder linear of `llm`'s float model in place (module
    docstring); returns ({rooflm linear name: GroupWeight/ChannelWeight}, the AWQ report).
    float_hessians / float_act_means: the float model's statistics (quantize.collect_hessians),
    used for o_proj's and down_proj's scales only."""
    from rooflm.quantize.gptq import gptq_quantize
    from rooflm.quantize.quantize import decoder_linears
    from rooflm.sampling_params import SamplingParams
    model = llm.engine.model
    lengths = [len(w) for w in windows]
    total = sum(lengths)
    check_one_step(llm, windows, "sequential AWQ")
    if block_windows < 1:
        raise ValueError(f"sequential AWQ: block_windows must be >= 1, got {block_windows}")
    quantize = config.quantizer()
    report = AwqReport()
    quantized: dict = {}
    stand_in: dict[str, torch.Tensor] = {}  # o_proj / down_proj quantized on float statistics
    plan = {}  # first linear -> (layer index, block, second linear, module of the block)
    for index, layer in enumerate(model.model.layers):
        groups = {name: tie for name, _, tie in _layer_groups(model, index)}
        prefix = f"model.layers.{index}"
        plan[f"{prefix}.self_attn.qkv_proj"] = (index, attention_block, f"{prefix}.self_attn.o_proj",
                                                layer.self_attn, groups[f"{prefix}.self_attn.o_proj"])
        plan[f"{prefix}.mlp.gate_up_proj"] = (index, mlp_block, f"{prefix}.mlp.down_proj", layer.mlp,
                                              groups[f"{prefix}.mlp.down_proj"])

    def gptq(mod, x: torch.Tensor):
        return gptq_quantize(mod.weight.detach().float(), x.T @ x, config.scheme.bits, config.scheme.group_size,
                             act_order=act_order, mse=mse, refit=refit,
                             mse_rows=range_search_rows(mod, config.gptq_mse_skip_qk), damp=config.gptq_damp)

    @torch.no_grad()
    def hook(mod, args, name):
        x = args[0].reshape(-1, mod.in_features).float()
        if name in quantized:
            raise RuntimeError(f"sequential AWQ: {name} ran twice; the calibration must be one prefill step")
        if x.shape[0] != total:
            raise RuntimeError(f"sequential AWQ: {name} saw {x.shape[0]} tokens in one step, expected all {total} "
                               f"calibration tokens (the scheduler split the prefill)")
        new_args = None
        if name in plan:
            index, block, second, block_module, tie = plan[name]
            follower = model.get_submodule(second)
            s2, alpha2, ratio2 = search_scale(follower.weight, float_hessians[second], float_act_means[second], config, tie)
            fold_scales(model, index, {second: s2})
            report.alpha[second], report.error_ratio[second] = alpha2, ratio2
            follower_q = quantize(follower.weight.float(), float_hessians[second] / (s2[:, None] * s2[None, :]))
            # The block inputs of the first windows: each request's tokens are contiguous in the step.
            starts = [0]
            for n in lengths[:block_windows]:
                starts.append(starts[-1] + n)
            inputs = tuple(x[a:b] for a, b in zip(starts[:-1], starts[1:]))
            error = _block_error(lambda xw, a, b: block(block_module, xw, a, b), inputs, mod.weight.float(),
                                 follower.weight.float(), follower_q)
            h = x.T @ x
            s, alpha, ratio = search_scale(mod.weight, h, x.abs().mean(dim=0), config, None, error,
                                           range_search_rows(mod, config.gptq_mse_skip_qk))
            fold_scales(model, index, {name: s})
            report.alpha[name], report.error_ratio[name] = alpha, ratio
            x = x / s[None, :]
            new_args = (args[0] / s.to(args[0].dtype),) + tuple(args[1:])
        q = gptq(mod, x)
        mod.weight.copy_(q.dequantize().to(mod.weight.dtype))
        quantized[name] = q
        return new_args

    linears = decoder_linears(model)
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: hook(mod, args, name))
               for name, m in linears.items()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # GPTQ's column loop: many tiny ops (commands.py)
    try:
        llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
        for h in handles:
            h.remove()
    missing = sorted(set(linears) - set(quantized))
    if missing:
        raise RuntimeError(f"sequential AWQ: the calibration forward never reached {missing[:3]}")
    return quantized, report
