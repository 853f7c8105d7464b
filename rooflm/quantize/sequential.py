"""Sequential GPTQ: each decoder linear's Hessian comes from the inputs the already QUANTIZED
linears before it produce (GPTQ paper Sec. 4 / AutoGPTQ's true_sequential), not from the float
model's activations.

Why: the float model's Hessians tell GPTQ how to compensate its rounding for inputs the quantized
model never sees; layer i's weights are then tuned to the float layer i-1's outputs while the
checkpoint feeds them the quantized layer i-1's. Calibrating on the quantized model's own inputs
lets each layer also absorb part of the error of everything before it.

How, in one calibration forward: a pre-hook on every decoder linear, which fire in execution order
(qkv_proj, o_proj, gate_up_proj, down_proj of layer 0, then layer 1, ...). Each hook builds the
Hessian from the input it is handed, quantizes its own linear with GPTQ and writes the dequantized
weight back before the linear runs. So o_proj sees the attention of the quantized q/k/v, down_proj
the activation of the quantized gate/up, and layer i+1 the output of the quantized layer i: both
AutoGPTQ's layer-by-layer order and its within-layer true_sequential, at the cost of one prefill.
This needs the whole calibration set in ONE forward step (every hook must see every token before
it quantizes), so the engine runs with max_num_batched_tokens >= the calibration tokens; the hook
checks it and names the fix otherwise.

AWQ's scales are folded before this pass (from the float model's statistics, as awq.py does):
o_proj's and down_proj's scales divide rows of qkv_proj and gate_up_proj, which must not change
after those are quantized, so the scales of a layer cannot wait for its quantized inputs here.
"""

from __future__ import annotations

from typing import Optional

import torch

from rooflm.quantize.gptq import DEFAULT_DAMP
from rooflm.quant.rtn import WeightScheme


def check_one_step(llm, windows: list[list[int]], what: str) -> None:
    """The engine must run every calibration window in ONE prefill step: enough batched tokens,
    sequences and KV cache (a full pool splits the step as surely as a small token budget)."""
    info = llm.engine.info
    total = sum(len(w) for w in windows)
    if info.max_num_batched_tokens < total:
        raise ValueError(f"{what} needs all {total} calibration tokens in one forward step, but max_num_batched_tokens "
                         f"is {info.max_num_batched_tokens}: build the LLM with max_num_batched_tokens>={total}")
    if info.max_num_seqs < len(windows):
        raise ValueError(f"{what} runs all {len(windows)} calibration windows in one step, but max_num_seqs is "
                         f"{info.max_num_seqs}: build the LLM with max_num_seqs>={len(windows)}")
    blocks = sum(-(-len(w) // info.block_size) for w in windows)
    if info.num_blocks < blocks:
        raise ValueError(f"{what} holds all {total} calibration tokens in the KV cache at once, but it has "
                         f"{info.kv_capacity_tokens} token slots: build the LLM with a larger cpu_kv_cache_gb "
                         f"(about {kv_cache_gb_for(info, blocks * info.block_size):.2f})")


def kv_cache_gb_for(info, tokens: int) -> float:
    """GiB of KV cache that hold `tokens` tokens of the engine's model (a 10% margin)."""
    return 1.1 * tokens * info.model_config.kv_bytes_per_token(info.kv_dtype_bytes) / 2**30


def capture_inputs(llm, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Every decoder linear's input over the calibration windows, [tokens, in_features] fp32, from
    one prefill of the model as it is now (the float model, for GPTQv2's targets). SmolLM2-135M
    at 32 windows of 512 tokens: ~6.4 GB."""
    from rooflm.quantize.quantize import decoder_linears
    from rooflm.sampling_params import SamplingParams
    check_one_step(llm, windows, "GPTQv2's float pass")
    inputs: dict[str, torch.Tensor] = {}

    def hook(mod, args, name):
        if name in inputs:
            raise RuntimeError(f"GPTQv2: {name} ran twice; the calibration must be one prefill step")
        inputs[name] = args[0].reshape(-1, mod.in_features).detach().float().clone()

    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: hook(mod, args, name))
               for name, m in decoder_linears(llm.engine.model).items()]
    try:
        llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return inputs


def sequential_gptq(llm, windows: list[list[int]], scheme: WeightScheme, act_order: bool = False,
                    mse: bool = False, hessians: Optional[dict[str, torch.Tensor]] = None,
                    refit: bool = False, mse_skip_qk: bool = False, damp: float = DEFAULT_DAMP,
                    v2_alpha: Optional[float] = None) -> dict:
    """Quantize every decoder linear of `llm`'s (float) model in place, layer by layer on the
    quantized predecessors' outputs; returns {rooflm linear name: GroupWeight/ChannelWeight}.
    The model's linear weights are left as the dequantized values (what the checkpoint loads to).
    `hessians`, if given, is filled with the Hessian each linear was quantized with.
    v2_alpha: GPTQv2's asymmetric calibration (gptq.asymmetric_target): each linear is fitted to
    the float model's outputs on the float model's inputs, captured first in one more prefill."""
    from rooflm.quantize.gptq import asymmetric_target, gptq_quantize, range_search_rows
    from rooflm.quantize.progress import progress_bar
    from rooflm.quantize.quantize import decoder_linears
    from rooflm.sampling_params import SamplingParams
    model = llm.engine.model
    total = sum(len(w) for w in windows)
    check_one_step(llm, windows, "sequential GPTQ")
    float_inputs = capture_inputs(llm, windows) if v2_alpha is not None else None
    quantized: dict = {}

    @torch.no_grad()
    def hook(mod, args, name):
        x = args[0].reshape(-1, mod.in_features).float()
        if name in quantized:
            raise RuntimeError(f"sequential GPTQ: {name} ran twice; the calibration must be one prefill step")
        if x.shape[0] != total:
            raise RuntimeError(f"sequential GPTQ: {name} saw {x.shape[0]} tokens in one step, expected all {total} "
                               f"calibration tokens (the scheduler split the prefill)")
        h = x.T @ x
        if hessians is not None:
            hessians[name] = h
        w = mod.weight.detach().float()
        if float_inputs is not None:
            x_float = float_inputs.pop(name)
            if x_float.shape != x.shape:
                raise RuntimeError(f"GPTQv2: {name}'s float pass saw {tuple(x_float.shape)} inputs, the quantized "
                                   f"pass {tuple(x.shape)}: the two prefills must batch the same tokens")
            w = asymmetric_target(w, h, (x_float - x).T @ x, v2_alpha, damp)
            del x_float
        # GPTQ's column loop is thousands of tiny ops: one thread (see commands.py).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            q = gptq_quantize(w, h, scheme.bits, scheme.group_size,
                              act_order=act_order, mse=mse, refit=refit,
                              mse_rows=range_search_rows(mod, mse_skip_qk), damp=damp)
        finally:
            torch.set_num_threads(threads)
        mod.weight.copy_(q.dequantize().to(mod.weight.dtype))
        quantized[name] = q
        bar.update(1)

    linears = decoder_linears(model)
    bar = progress_bar(len(linears), "sequential GPTQ")
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: hook(mod, args, name))
               for name, m in linears.items()]
    try:
        llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        bar.close()
        for h in handles:
            h.remove()
    missing = sorted(set(linears) - set(quantized))
    if missing:
        raise RuntimeError(f"sequential GPTQ: the calibration forward never reached {missing[:3]}")
    return quantized
