"""Quantized weights: formats, the kernels that multiply them, and the tools that make them.

The narrow interface the rest of rooflm sees:

- quantized tensors, one per linear weight, each with `shape`, `format`, `dequantize()` and `cat()`
  (fused shards): `gguf_blocks.BlockTensor` (GGUF Q4_0/Q4_1/Q8_0/Q4_K blocks) and
  `formats.GroupWeight` / `formats.ChannelWeight` (4-bit group-wise / 8-bit per-channel, decoded
  from GPTQ, AWQ or compressed-tensors pack-quantized checkpoints by `checkpoint.group_quantized`,
  or made by `rtn` / `gptq`);
- `linear_method.make_linear_method(weight, device, dtype)`: the module that computes `x @ W.T`
  from one (`QuantizedLinearMethod`: torch's CPU kernels for GGUF blocks, the Triton W4A16/W8A16
  kernels on CUDA), or None where no kernel on that device takes it (the caller dequantizes);
- `rtn.quantize_model` (`--quantization int8|int4-gN` at load) and `rooflm quantize`
  (`quantize.py`, `commands.py`): offline RTN or GPTQ into a GPTQ-layout HF directory.

Nothing here imports the model or the engine at module level; `layers/linear.py` holds a
QuantizedLinearMethod as its weight.
"""
