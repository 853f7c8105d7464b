"""Quantized weights: formats and the kernels that multiply them.

The narrow interface the rest of rooflm sees:

- `gguf_blocks.BlockTensor`: a GGUF tensor kept in its quantized blocks (Q4_0, Q4_1, Q8_0),
  with the row operations a loader needs (concatenate fused shards, permute q/k rows) and
  `dequantize()` for the exact float values.
- `linear_method.make_quantized_linear(blocks)`: the module that computes `x @ W.T` from them
  (`QuantizedLinearMethod`), or None where no kernel on this device takes that format.

Neither imports the model or the engine; `layers/linear.py` holds one as its weight.
"""
