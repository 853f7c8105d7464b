"""`rooflm quantize`: a float model (HF directory or GGUF, anything rooflm loads) -> a GPTQ-layout
HF directory that rooflm, transformers (with a GPTQ backend) and vLLM recognise.

Steps:
1. load the model through rooflm itself, every weight in fp32 (`--quantization none`);
2. for GPTQ and AWQ, run calibration windows through the engine with a pre-hook on every decoder linear
   that sums x x^T of its inputs (the Hessian of the layer's squared output error);
3. for AWQ (awq.py), search per-input-channel scales and fold them into the float model (norm
   weights, v and up rows), then quantize the scaled weights;
4. quantize each decoder linear (--method gptq by default sequentially, sequential.py: each linear's Hessian
   from the quantized predecessors' outputs, in one more calibration prefill): RTN (rtn.py), GPTQ (gptq.py), AWQ-clipped RTN or GPTQ after AWQ; fused q/k/v and gate/up share
   their input, so they are quantized fused (rows are independent) and split back to HF names;
5. write model.safetensors (GPTQ v1 tensors per linear; norms, embeddings and the LM head in
   --float-dtype: the LM head and embeddings are never quantized), config.json with its
   quantization_config, and the tokenizer.

Layout written: GPTQ v1 (formats.py): int4 asymmetric group-wise (`sym: false`; `desc_act: true`
with --act-order, the permutation in g_idx) or int8 symmetric per channel (`bits: 8, group_size: -1`).
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
from typing import Optional

import torch

from rooflm.quant.formats import to_gptq
from rooflm.quantize.gptq import DEFAULT_DAMP, range_search_rows
from rooflm.quantize.progress import progress_bar
from rooflm.quant.rtn import WeightScheme, quantize_weight

logger = logging.getLogger(__name__)

_SPLITS = {"qkv_proj": ("self_attn", {"q": "q_proj", "k": "k_proj", "v": "v_proj"}),
           "gate_up_proj": ("mlp", {"gate": "gate_proj", "up": "up_proj"})}


def decoder_linears(model) -> dict[str, torch.nn.Module]:
    """rooflm module name -> Linear, for every linear of the decoder layers."""
    from rooflm.layers.linear import Linear
    return {f"model.layers.{i}.{name}": m for i, layer in enumerate(model.model.layers)
            for name, m in layer.named_modules() if isinstance(m, Linear)}


def collect_hessians(llm, windows: list[list[int]],
                     abs_means: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Sum of x x^T of each decoder linear's inputs over the calibration windows (prefill).
    With `abs_means`, also fills it with each linear's mean |x| per input channel (AWQ)."""
    from rooflm.sampling_params import SamplingParams
    model = llm.engine.model
    hessians: dict[str, torch.Tensor] = {}
    abs_sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    handles = []
    for name, module in decoder_linears(model).items():
        # fp32 sums: tens of thousands of outer products lose ~1e-5 relative, far below the
        # 1% damping GPTQ adds to the diagonal (fp64 took 2-3x longer on the CPU).
        hessians[name] = torch.zeros(module.in_features, module.in_features)
        abs_sums[name] = torch.zeros(module.in_features)

        def hook(mod, args, name=name):
            x = args[0].reshape(-1, mod.in_features).float()
            hessians[name].addmm_(x.T, x)
            abs_sums[name] += x.abs().sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        handles.append(module.register_forward_pre_hook(hook))
    try:
        llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    if abs_means is not None:
        for name, total in abs_sums.items():
            abs_means[name] = total / max(counts.get(name, 0), 1)
    return hessians


def quantize_linear(w: torch.Tensor, scheme: WeightScheme, method: str, hessian: Optional[torch.Tensor],
                    act_order: bool = False, mse: bool = False, refit: bool = False,
                    mse_rows: Optional[torch.Tensor] = None, damp: float = DEFAULT_DAMP):
    """method: rtn | gptq | awq (weights already AWQ-scaled: RTN with the clip search when a Hessian
    is given) | awq+gptq (weights already AWQ-scaled, the Hessian rescaled to match: GPTQ).
    damp: GPTQ's diagonal damping (gptq_quantize)."""
    if method in ("gptq", "awq+gptq"):
        from rooflm.quantize.gptq import gptq_quantize
        return gptq_quantize(w, hessian, scheme.bits, scheme.group_size, act_order=act_order, mse=mse, refit=refit,
                             mse_rows=mse_rows, damp=damp)
    if method == "awq" and hessian is not None and scheme.bits == 4:
        from rooflm.quantize.awq import AwqConfig, clipped_rtn_int4
        return clipped_rtn_int4(w, hessian, scheme.group_size, AwqConfig(scheme).shrinks)
    return quantize_weight(w, scheme)


def _rows(weight, start: int, size: int):
    """Rows [start, start + size) of a GroupWeight/ChannelWeight."""
    from rooflm.quant.formats import ChannelWeight, GroupWeight
    if isinstance(weight, GroupWeight):
        return dataclasses.replace(weight, codes=weight.codes[start:start + size],
                                   scales=weight.scales[:, start:start + size],
                                   zeros=weight.zeros[:, start:start + size])
    return ChannelWeight(weight.codes[start:start + size], weight.scales[start:start + size],
                         weight.zeros[start:start + size], weight.format)


def quantized_state_dict(model, scheme: WeightScheme, method: str, hessians: Optional[dict],
                         float_dtype: torch.dtype, act_order: bool = False, mse: bool = False,
                         prequantized: Optional[dict] = None, refit: bool = False,
                         mse_skip_qk: bool = False, damp: float = DEFAULT_DAMP) -> dict[str, torch.Tensor]:
    """HF-named tensors: GPTQ parts for decoder linears, float for everything else.
    prequantized: linear name -> its already quantized weight (sequential.py), written as is."""
    out: dict[str, torch.Tensor] = {}
    linears = decoder_linears(model)
    linear_params = {f"{name}.{kind}" for name in linears for kind in ("weight", "bias")}
    for name, param in model.named_parameters():
        if name not in linear_params:
            if param.numel():
                out[name] = param.detach().to(float_dtype).contiguous()
    bar = progress_bar(len(linears), f"{method} {scheme.bits}-bit") if prequantized is None else None
    for name, module in linears.items():
        prefix, _, leaf = name.rpartition(".")
        if prequantized is not None:
            q = prequantized[name]
        else:
            q = quantize_linear(module.weight.detach().float(), scheme, method,
                                None if hessians is None else hessians[name], act_order, mse, refit,
                                range_search_rows(module, mse_skip_qk), damp)
            bar.update(1)
        if leaf in _SPLITS:
            _, names = _SPLITS[leaf]
            for shard, (offset, size) in module.shard_offsets.items():
                target = f"{prefix}.{names[shard]}"
                for part, t in to_gptq(_rows(q, offset, size), scheme.bits).items():
                    out[f"{target}.{part}"] = t
                if module.bias is not None:
                    out[f"{target}.bias"] = module.bias.detach()[offset:offset + size].to(float_dtype)
        else:
            for part, t in to_gptq(q, scheme.bits).items():
                out[f"{name}.{part}"] = t
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias.detach().to(float_dtype)
    if bar is not None:
        bar.close()
    return out


def fp8_state_dict(model, float_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors for `--scheme fp8`: compressed-tensors fp8 (e4m3 weight, per-channel
    weight_scale) for decoder linears, float for everything else (fp8.py)."""
    from rooflm.quant.fp8 import Fp8Weight, quantize_fp8_weight, to_compressed_tensors
    out: dict[str, torch.Tensor] = {}
    linears = decoder_linears(model)
    linear_params = {f"{name}.{kind}" for name in linears for kind in ("weight", "bias")}
    for name, param in model.named_parameters():
        if name not in linear_params and param.numel():
            out[name] = param.detach().to(float_dtype).contiguous()
    for name, module in linears.items():
        prefix, _, leaf = name.rpartition(".")
        q = quantize_fp8_weight(module.weight)
        shards = ([(f"{prefix}.{_SPLITS[leaf][1][shard]}", offset, size)
                   for shard, (offset, size) in module.shard_offsets.items()]
                  if leaf in _SPLITS else [(name, 0, module.out_features)])
        for target, offset, size in shards:
            part = Fp8Weight(q.codes[offset:offset + size], q.scales[offset:offset + size])
            for kind, t in to_compressed_tensors(part).items():
                out[f"{target}.{kind}"] = t
            if module.bias is not None:
                out[f"{target}.bias"] = module.bias.detach()[offset:offset + size].to(float_dtype)
    return out


def gptq_config(scheme: WeightScheme, act_order: bool = False, sequential: bool = False,
                damp: float = DEFAULT_DAMP) -> dict:
    return {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
            "desc_act": act_order and scheme.bits == 4, "sym": scheme.bits == 8, "checkpoint_format": "gptq", "lm_head": False,
            "true_sequential": sequential, "damp_percent": damp}


def write_checkpoint(out_dir: str, config_dict: dict, tensors: dict[str, torch.Tensor], scheme: Optional[WeightScheme],
                     float_dtype: torch.dtype, tokenizer=None, note: str = "", act_order: bool = False,
                     quant_config: Optional[dict] = None, sequential: bool = False,
                     damp: float = DEFAULT_DAMP) -> None:
    """quant_config: config.json's quantization_config; default the GPTQ one of `scheme`."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(config_dict)
    cfg["quantization_config"] = quant_config if quant_config is not None else gptq_config(scheme, act_order, sequential, damp)
    cfg["torch_dtype"] = str(float_dtype).replace("torch.", "")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        from rooflm.tokenizer.dummy_model_dir import embed_chat_template
        tokenizer.hf.save_pretrained(out_dir)
        embed_chat_template(out_dir, tokenizer.chat_template)
    if note:
        with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write(note + "\n")
