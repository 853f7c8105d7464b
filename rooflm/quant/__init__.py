"""Quantized weights at run time: their formats and the linear methods that multiply them.

The narrow interface the rest of rooflm sees:

- quantized tensors, one per linear weight, each with `shape`, `format`, `dequantize()` and `cat()`
  (fused shards): `gguf_blocks.BlockTensor` (GGUF Q4_0/Q4_1/Q8_0/Q4_K blocks) and
  `formats.GroupWeight` / `formats.ChannelWeight` (4-bit group-wise / 8-bit per-channel, decoded
  from GPTQ, AWQ or compressed-tensors pack-quantized checkpoints by `checkpoint.group_quantized`,
  or made by `rtn` and rooflm/quantize/);
- `linear_method.make_linear_method(weight, device, dtype)`: the module that computes `x @ W.T`
  from one (`QuantizedLinearMethod`: torch's CPU kernels for GGUF blocks, the Triton W4A16/W8A16
  kernels on CUDA), or None where no kernel on that device takes it (the caller dequantizes);
- `rtn` / `fp8`: the weight conversions that `--quantization int8|int4-gN|fp8` applies at load
  (rooflm/model/quantize_on_load.py walks the model) and `rooflm quantize` applies offline
  (rooflm/quantize/: RTN, GPTQ, AWQ into a GPTQ-layout or compressed-tensors HF directory).

quant sits below layers: it imports only kernels and config, and `layers/linear.py` holds a
QuantizedLinearMethod as its weight.
"""
