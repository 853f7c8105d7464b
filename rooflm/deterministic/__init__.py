"""--deterministic: batch-invariant inference.

A request's tokens and logprobs must not depend on what else the engine runs: the batch size,
the step's token count, how its prompt was chunked, whether it was preempted and recomputed or
swapped, whether its prefix came from the cache, whether the step ran in a CUDA graph. Floating
point sums are not associative, so this holds only if every reduction a token's numbers go
through is summed in an order that depends on that token's own inputs. The mode swaps in, at
the engine's existing seams (layers/kernels.py, the attention backend), kernels that do so:

  matmuls (every linear layer and the LM head)
      GPU: rooflm/kernels/matmul_fixed_split.py, k16 slices summed in k order for every M and a split-K whose
      split count follows the weight's shape, never M (cuBLAS picks tiles and split-K from M):
      each split's sum, then the splits added in order; S = 1 is matmul_persistent.py's single
      K loop. Tiles (their K step included) and the schedule (split programs + in-order reduce,
      or one program looping over the splits) follow M, which changes which program sums an
      element, not the order of the sum. The batch-1 fused GEMV path is off.
      CPU: one row at a time (torch's CPU matmul picks its kernel from M too).
  RMSNorm
      the Triton kernel already owns one row per program with a tile shape that follows the
      hidden size only; q/k head norms (Qwen3) go through it too.
  attention
      GPU: every query row, decodes included, through the prefill kernel with one masked loop
      over key tiles from position 0 (layers/cuda_attention.py, deterministic=True): no split-KV
      whose count followed the batch, no decode kernel with its own tile order, no unmasked
      fast loop whose rounding differed from the masked one.
      CPU: attention one query token at a time (attention.py here).
  elementwise ops, embedding, RoPE, the sampler
      already row-wise; seeded requests sample from their own generator.

What it costs is measured by benchmarks/deterministic.sh (docs/deterministic.md).
"""

from rooflm.deterministic.kernels import deterministic_kernels, rowwise_linear, triton_linear

__all__ = ["deterministic_kernels", "rowwise_linear", "triton_linear"]
