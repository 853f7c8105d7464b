"""`--quantization int8 | int4-g<N> | fp8` at load: a loaded float model's linears become quantized.

The weight conversions are quant/'s (rtn.py: round-to-nearest int8/int4, fp8.py: per-channel
E4M3); this file walks the model's parts and swaps each Linear's float weight for the quantized
method (gpt-fast's convert_for_runtime), so it sits above both quant/ and layers/.
"""

from __future__ import annotations

import torch

from rooflm.layers.linear import Linear
from rooflm.layers.moe import Experts
from rooflm.quant.fp8 import quantize_fp8_weight
from rooflm.quant.linear_method import Fp8Linear, make_linear_method
from rooflm.quant.rtn import WeightScheme, quantize_weight


@torch.no_grad()
def quantize_int(model: torch.nn.Module, scheme_name: str) -> None:
    """RTN-quantize every decoder-layer linear and an untied LM head of a loaded float model in
    place (as gpt-fast's int8/int4 modes do; embeddings, and a head tied to them, stay in float),
    on the weights' own device; those layers then run the quantized kernels."""
    scheme = WeightScheme.parse(scheme_name)
    linears = list(model.model.layers.modules())
    if getattr(model, "lm_head", None) is not None:
        linears.append(model.lm_head)
    for module in linears:
        if not isinstance(module, Linear) or module.quant is not None:
            continue
        weight = module.weight
        method = make_linear_method(quantize_weight(weight, scheme, weight.dtype), weight.device, weight.dtype)
        if method is None:  # no kernel on this device: keep the RTN error, in float
            weight.copy_(quantize_weight(weight, scheme, weight.dtype).dequantize().to(weight.dtype))
            continue
        module.quant = method
        module.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
    model.disable_gemv_where_quantized()
    if torch.cuda.is_available():
        # The freed float weights stay in torch's cache otherwise, and the KV pool is sized from
        # what the device reports free.
        torch.cuda.empty_cache()


@torch.no_grad()
def quantize_fp8(model: torch.nn.Module) -> None:
    """`--quantization fp8`: every decoder-layer linear of a loaded float model becomes an
    Fp8Linear (per-channel weights, dynamic per-token activations), on the weights' own device,
    and a mixture of experts' stacked experts become E4M3 codes with per-channel scales (the
    fused MoE kernel's W8A8 path; the router stays in float, as vLLM's fp8 MoE keeps its gate).
    The LM head and embeddings stay in float."""
    for module in model.model.layers.modules():
        if isinstance(module, Experts):
            module.quantize_fp8()
            continue
        if not isinstance(module, Linear) or module.quant is not None:
            continue
        weight = module.weight
        module.quant = Fp8Linear(quantize_fp8_weight(weight), weight.device)
        module.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
    model.disable_gemv_where_quantized()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed float weights, before the KV pool is sized
