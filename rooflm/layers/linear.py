"""Linear layers whose weights are fused from several checkpoint tensors.

Fusing q/k/v into one matmul and gate/up into another halves the kernel
launches of a layer. The checkpoint stores them apart, so each fused layer
knows which row range a named shard goes to.

A layer's weight is either a float parameter or, when the checkpoint's weights are kept
quantized (GGUF Q4_0/Q4_1/Q8_0/Q4_K on the CPU, and on one CUDA device with --quantization gguf;
GPTQ/AWQ/compressed-tensors int4/int8 on CUDA), a rooflm.quant QuantizedLinearMethod that multiplies them directly; forward
does not change for the model.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rooflm.quant.formats import is_quantized_tensor
from rooflm.quant.linear_method import QuantizedLinearMethod, make_linear_method


class Linear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, kernel=None):
        super().__init__()
        # Kernels.linear (layers/kernels.py): small_m_linear on CUDA, the batch-invariant matmul with
        # --deterministic, None on the CPU (F.linear).
        self.kernel = kernel
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None
        self.quant: Optional[QuantizedLinearMethod] = None
        # rooflm.lora's hook, y = lora(x, y): installed with --enable-lora only, so without it a
        # forward pays this one attribute test.
        self.lora = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x, self.weight, self.bias, self.quant)
        elif self.quant is not None:
            y = self.quant(x)
            y = y if self.bias is None else y + self.bias
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def _lora_active(self) -> bool:
        """Whether this step's tokens run an adapter through this layer: the fused forms (folded,
        SiLU-mul, FP8 codes) then step aside for forward, where the hook sits."""
        return self.lora is not None and self.lora.active

    def forward_folded(self, x: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                       residual: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """One token's W @ rmsnorm(x) (norm_weight) or residual + W x in one kernel where the
        quantized method has one (W4A16 on CUDA), else None: the caller runs them apart."""
        if self.quant is None or self.bias is not None or self._lora_active():
            return None
        return self.quant.folded(x, norm_weight=norm_weight, eps=eps, residual=residual)

    def fp8_input(self):
        """This layer's quantized method when it takes E4M3 codes from the op before it
        (QuantizedLinearMethod.takes_fp8_input: FP8 W8A8 on fp8 tensor cores), else None."""
        quant = self.quant
        return quant if quant is not None and quant.takes_fp8_input else None

    def forward_fp8(self, qx: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y = (qx * sx) @ W.T (+ bias) in `dtype`, for a layer whose fp8_input() answers."""
        y = self.quant.forward_fp8(qx, sx).to(dtype)
        return y if self.bias is None else y + self.bias

    def stored_weight_bytes(self) -> int:
        """Bytes the weight holds in memory: the quantized blocks and scales, or the floats."""
        if self.quant is not None:
            return self.quant.weight_bytes()
        return self.weight.numel() * self.weight.element_size()

    def load_blocks(self, blocks) -> None:
        """Take a whole weight in quantized blocks: kept as they are where a kernel multiplies
        them on this layer's device, else dequantized into the float weight."""
        expected = (self.out_features, self.in_features)
        if blocks.shape != expected:
            raise ValueError(f"shape mismatch: checkpoint {blocks.shape}, model expects {expected}")
        method = make_linear_method(blocks, self.weight.device, self.weight.dtype)
        if method is None:
            with torch.no_grad():
                self.weight.copy_(blocks.dequantize())
            return
        self.quant = method
        # The float weight is never read again; an empty one keeps the parameter's name
        # (and frees out_features x in_features floats).
        self.weight = torch.nn.Parameter(self.weight.new_empty(0), requires_grad=False)


class FusedLinear(Linear):
    """Rows [offset, offset + size) of the output belong to the shard named `name`."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False, kernel=None):
        super().__init__(in_features, sum(shard_sizes.values()), bias, kernel)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        # Quantized shards wait here until finish_loading: fusing needs all of them.
        self._block_shards: dict = {}

    def load_shard(self, shard: str, param_kind: str, tensor) -> None:
        offset, size = self.shard_offsets[shard]
        target: Optional[torch.nn.Parameter] = self.weight if param_kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {shard} bias but the model config has none")
        expected = (size,) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shape mismatch for {shard}.{param_kind}: checkpoint {tuple(tensor.shape)}, "
                f"model expects {expected}")
        if is_quantized_tensor(tensor):
            self._block_shards[shard] = tensor
            return
        with torch.no_grad():
            target[offset:offset + size].copy_(tensor)

    def forward_silu_mul(self, x: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                         eps: float = 1e-6) -> Optional[torch.Tensor]:
        """silu(gate) * up in one kernel when this is the gated MLP's {"gate", "up"} (each rank's
        rows of both, in that order) held quantized, or None (the MLP runs forward, then SiLU-mul).
        norm_weight: of rmsnorm(x), folded in too (one token; None where the method cannot)."""
        if (self.quant is None or self.bias is not None or list(self.shard_offsets) != ["gate", "up"]
                or self._lora_active()):
            return None
        if self.shard_offsets["gate"][1] != self.shard_offsets["up"][1]:
            return None
        if norm_weight is not None:
            return self.quant.folded(x, norm_weight=norm_weight, eps=eps, gated=True)
        return self.quant.gate_up_silu_mul(x)

    def finish_loading(self) -> None:
        """Fuse the quantized shards into one quantized weight when every shard came in one
        block format; otherwise (a mixed checkpoint) dequantize them into the float weight."""
        shards, self._block_shards = self._block_shards, {}
        if not shards:
            return
        formats = {blocks.format for blocks in shards.values()}
        if len(shards) == len(self.shard_offsets) and len(formats) == 1:
            parts = [shards[name] for name in self.shard_offsets]
            try:
                fused = type(parts[0]).cat(parts)
            except ValueError:  # e.g. GPTQ act-order shards with different permutations
                fused = None
            if fused is not None:
                self.load_blocks(fused)
                return
        for name, blocks in shards.items():
            offset, size = self.shard_offsets[name]
            with torch.no_grad():
                self.weight[offset:offset + size].copy_(blocks.dequantize())
