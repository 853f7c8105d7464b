"""Linear layers that multiply block-quantized weights without dequantizing them to float.

Where rooflm's native kernels build (rooflm/quant/native.py: a C compiler and AVX2/FMA),
NativeBlockLinear takes every 4-bit and 8-bit format with the file's exact blocks (Q4_K's
per-32 scale d * sc and offset dmin * m are rounded to the kernel's fp16: up to 2^-12 relative a
block); the torch kernel modules below are the fallback.

On CUDA a GGUF weight goes to the Triton kernels instead (make_linear_method): its blocks as a
formats.GroupWeight of group 32 (formats.from_gguf_blocks), W4A16 for Q4_0/Q4_1/Q4_K and
W8A16's group-wise path for Q8_0, scales and zeros in fp16/fp32 exactly as decoded.

Why: batch-1 decode reads every weight once per token. SmolLM2-135M dequantized to fp32 is
0.54 GB a token; its Q4_1 blocks as torch's packed int4 are 4.5 bits a weight (~60 MB for the
decoder layers). The kernels are torch's own CPU weight-only GEMMs:

  4-bit (Q4_0, Q4_1, Q4_K): aten._weight_int4pack_mm_for_cpu, groups of 32 along K with one
      (scale, zero) pair per group and row, value = (code - 8) * scale + zero. A GGUF block is
      exactly one group: scale = d, zero = offset + 8 d. Only the rounding of scale and zero to
      bf16 (the kernel's activation dtype) changes the weights.
  8-bit (Q8_0): aten._weight_int8pack_mm, one scale per row, while Q8_0 has one per block of
      32. With few blocks per row (K <= 2048: SmolLM2's tied LM head has 18) the matmul runs
      once per block column with that column's scales and the partial products are summed:
      the file's exact codes, for the same bytes read. With more, the launches would cost more
      than the reads, so the rows are requantized to one scale (symmetric, max |w| / 127),
      which moves each weight by up to 1/254 of its row's largest.

Both kernels are vectorised for bf16 activations on AVX2/AVX-512 (fp32 activations take a
scalar path ~10x slower, measured on the project's AMD EPYC), so activations are rounded to
bf16 for the matmul and the result is returned in the caller's dtype. Outputs therefore match
a float32 model to about bf16 precision, not bit for bit; `--quantization none` keeps the
exact dequantized float path.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

import rooflm.envs as envs
from rooflm.quant import native
from rooflm.quant.gguf_blocks import BLOCK, BlockTensor

logger = logging.getLogger(__name__)

ACT_DTYPE = torch.bfloat16
# ROOFLM_FP8_FUSED_QUANT=0: FP8 W8A8 linears quantize their own float input (a kernel of its own
# after each norm and SiLU-mul) instead of taking the codes those ops write (kernels/norm_act_fp8.py).
# ROOFLM_FP8_FAST_ACCUM=0: FP8 products promote their partial sums to fp32 (_scaled_mm's default; slower).


def cpu_kernels_available() -> bool:
    """Whether this torch has the CPU weight-only kernels (torch >= 2.5 for the int4 one)."""
    aten = torch.ops.aten
    return all(hasattr(aten, op) for op in ("_weight_int4pack_mm_for_cpu",
                                            "_convert_weight_to_int4pack_for_cpu",
                                            "_weight_int8pack_mm"))


class QuantizedLinearMethod(torch.nn.Module):
    """y = x @ W.T (+ bias) for a quantized W; holds the packed weight as buffers."""

    in_features: int
    out_features: int
    format: str

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def gate_up_silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """silu(gate) * up from this weight when it is a gated MLP's gate_up [2I, K] (gate rows, then
        up rows) in one kernel, or None where the method has none (the caller runs the linear, then
        SiLU-mul)."""
        return None

    # Whether folded() may answer at all: the layer asks before it prepares anything for it.
    can_fold = False

    def folded(self, x: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
               residual: Optional[torch.Tensor] = None, gated: bool = False) -> Optional[torch.Tensor]:
        """One token through this weight with the layer's neighbours in the same kernel: W @
        rmsnorm(x) (norm_weight; gated: silu(gate) * up of it) or residual + W x; None where the
        method has no such kernel (the caller runs them apart)."""
        return None

    # FP8 W8A8 methods that take their activations already quantized (forward_fp8): the norm or
    # SiLU-mul before them writes E4M3 codes and scales in its own kernel (kernels/norm_act_fp8.py).
    # False: the method takes floats only.
    # Such a method also has `input_scale`: the checkpoint's static per-tensor activation scale
    # [1, 1] fp32 the codes must use, or None (per-token scales).
    takes_fp8_input = False

    def forward_fp8(self, qx: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """y = (qx * sx) @ W.T for E4M3 codes qx [M, K] and fp32 scales sx [M, 1] (takes_fp8_input)."""
        raise NotImplementedError(f"{type(self).__name__} takes float activations only")


class Int4GroupLinear(QuantizedLinearMethod):
    def __init__(self, blocks: BlockTensor):
        super().__init__()
        rows, cols = blocks.shape
        self.in_features, self.out_features, self.format = cols, rows, blocks.format
        codes = torch.from_numpy(blocks.codes).to(torch.int32)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        scale = torch.from_numpy(blocks.scale)
        zero = torch.from_numpy(blocks.offset) + 8.0 * scale
        # [K / 32, N, 2]: the kernel's layout, groups outermost.
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(ACT_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's [T, K]: no reshapes (a decode step is host-bound)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACT_DTYPE), self.packed, BLOCK,
                                                           self.scales_and_zeros)
            return y.to(x.dtype)
        flat = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, BLOCK, self.scales_and_zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int8BlockLinear(QuantizedLinearMethod):
    def __init__(self, blocks: BlockTensor):
        super().__init__()
        rows, cols = blocks.shape
        self.in_features, self.out_features, self.format = cols, rows, blocks.format
        self.num_blocks = cols // BLOCK
        codes = torch.from_numpy(blocks.codes).reshape(rows, self.num_blocks, BLOCK)
        self.register_buffer("codes", codes.transpose(0, 1).contiguous())  # [blocks, N, 32]
        self.register_buffer("scale", torch.from_numpy(blocks.scale).T.contiguous().to(ACT_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [blocks, T, 32] in one copy, so that each block column is a contiguous slice.
        columns = x.reshape(-1, self.num_blocks, BLOCK).to(ACT_DTYPE).transpose(0, 1).contiguous()
        # Partial sums in fp32: the kernel returns bf16, and 18 bf16 roundings of partials
        # larger than their sum would add up.
        y = torch.zeros(columns.shape[1], self.out_features, dtype=torch.float32)
        for b in range(self.num_blocks):
            y += torch.ops.aten._weight_int8pack_mm(columns[b], self.codes[b], self.scale[b])
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class NativeBlockLinear(QuantizedLinearMethod):
    """The file's blocks multiplied by rooflm's own C kernels (rooflm/quant/native.py): the
    exact codes, scales and offsets, with activations quantized to int8 per block of 32."""

    def __init__(self, blocks: BlockTensor, lib):
        super().__init__()
        rows, cols = blocks.shape
        self.in_features, self.out_features, self.format = cols, rows, blocks.format
        self._lib = lib
        codes = blocks.codes.reshape(rows, cols // BLOCK, BLOCK)
        if blocks.bits == 4:  # two codes a byte: element j in the low nibble, j + 16 in the high
            packed = codes[:, :, :BLOCK // 2] | (codes[:, :, BLOCK // 2:] << 4)
            self.register_buffer("codes", torch.from_numpy(packed.astype("uint8")).contiguous())
            self.register_buffer("offset", torch.from_numpy(blocks.offset).to(torch.float16).contiguous())
        else:
            self.register_buffer("codes", torch.from_numpy(blocks.codes).contiguous())
            self.offset = None
        # fp16, as in the file (decoded exactly from it): the file's bytes per weight.
        self.register_buffer("scale", torch.from_numpy(blocks.scale).to(torch.float16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        if self.offset is not None:
            y = native.q4_linear(self._lib, flat, self.codes, self.scale, self.offset)
        else:
            y = native.q8_linear(self._lib, flat, self.codes, self.scale)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


# Above this many blocks per row a Q8_0 weight is requantized per row (see the header).
MAX_Q8_BLOCK_COLUMNS = 64


class Int8RowLinear(QuantizedLinearMethod):
    def __init__(self, blocks: BlockTensor):
        super().__init__()
        rows, cols = blocks.shape
        self.in_features, self.out_features, self.format = cols, rows, blocks.format
        weight = blocks.dequantize()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        codes = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.to(ACT_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def make_quantized_linear(blocks: BlockTensor, device: torch.device) -> Optional[QuantizedLinearMethod]:
    """The module for `blocks` on `device`, or None when no kernel here takes the format
    (then the caller dequantizes). The CPU kernels; make_linear_method sends CUDA to Triton's."""
    if device.type != "cpu":
        return None
    lib = native.library()
    if lib is not None:
        return NativeBlockLinear(blocks, lib)
    if not cpu_kernels_available():
        return None
    if blocks.bits == 4:
        # The packed int4 layout tiles 16 output rows (torch's _convert_weight_to_int4pack_cpu).
        return Int4GroupLinear(blocks) if blocks.shape[0] % 16 == 0 else None
    if blocks.shape[1] // BLOCK <= MAX_Q8_BLOCK_COLUMNS:
        return Int8BlockLinear(blocks)
    return Int8RowLinear(blocks)


# ---------------------------------------------------------------------------
# CUDA: the Triton weight-only kernels (rooflm/kernels/w4a16.py, w8a16.py)
# ---------------------------------------------------------------------------

class W4A16Linear(QuantizedLinearMethod):
    """4-bit group-wise weights (GPTQ, AWQ, rooflm quantize, RTN at load) in the kernel's packing."""

    def __init__(self, weight, device: torch.device, act_dtype: torch.dtype):
        super().__init__()
        from rooflm.kernels.int4_pack import pack_int4
        self.out_features, self.in_features = weight.shape
        self.format, self.group_size = weight.format, weight.group_size
        self.register_buffer("qweight", pack_int4(weight.codes, weight.group_size).to(device))
        # The kernel reads scales and zeros in whatever float dtype they come in (to fp32 in
        # registers): GGUF's (keep_dtype) stay fp16/fp32, exact, not rounded to bf16.
        param_dtype = None if weight.keep_dtype else act_dtype
        self.register_buffer("scales", weight.scales.to(device=device, dtype=param_dtype).contiguous())
        self.register_buffer("zeros", weight.zeros.to(device=device, dtype=param_dtype).contiguous())
        self.register_buffer("perm", None if weight.perm is None else weight.perm.to(device))
        # The mma kernel folds on CUDA; act-order permutes x's K, which the norm's weight would need too.
        self.can_fold = device.type == "cuda" and weight.perm is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rooflm.kernels.w4a16 import w4a16_linear
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        y = w4a16_linear(flat, self.qweight, self.scales, self.zeros, self.group_size)
        return y.reshape(*x.shape[:-1], self.out_features)

    def gate_up_silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        from rooflm.kernels.w4a16 import w4a16_gate_up_silu_mul
        if x.dim() != 2:
            return None
        if self.perm is not None:  # act-order: K's permutation, the same for every row
            x = x.index_select(1, self.perm)
        return w4a16_gate_up_silu_mul(x, self.qweight, self.scales, self.zeros, self.group_size)

    def folded(self, x: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
               residual: Optional[torch.Tensor] = None, gated: bool = False) -> Optional[torch.Tensor]:
        from rooflm.kernels.w4a16 import w4a16_folded
        if self.perm is not None:  # act-order permutes x's K: the norm's weight would need it too
            return None
        return w4a16_folded(x, self.qweight, self.scales, self.zeros, self.group_size, norm_weight=norm_weight,
                            eps=eps, residual=residual, gated=gated)


class W8A16Linear(QuantizedLinearMethod):
    """int8 weights: a ChannelWeight (one scale a row) or an 8-bit GroupWeight (GGUF Q8_0: one scale
    per row and group of inputs, the kernel's group-wise path)."""

    def __init__(self, weight, device: torch.device, act_dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight.format
        self.group_size = getattr(weight, "group_size", 0)
        if getattr(weight, "perm", None) is not None:
            raise ValueError("8-bit group-wise weights with an act-order permutation are not supported")
        param_dtype = None if getattr(weight, "keep_dtype", False) else act_dtype
        self.register_buffer("qweight", weight.codes.to(device=device, dtype=torch.int8).contiguous())
        self.register_buffer("scales", weight.scales.to(device=device, dtype=param_dtype).contiguous())
        # Symmetric weights (zero 0 everywhere) skip the zero-point term.
        has_zero = bool((weight.zeros != 0).any())
        self.register_buffer("zeros", weight.zeros.to(device=device, dtype=param_dtype).contiguous()
                             if has_zero else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rooflm.kernels.w8a16 import w8a16_linear
        y = w8a16_linear(x.reshape(-1, self.in_features), self.qweight, self.scales, self.zeros,
                         group_size=self.group_size)
        return y.reshape(*x.shape[:-1], self.out_features)


# ---------------------------------------------------------------------------
# FP8 W8A8 (quant/fp8.py): torch._scaled_mm on sm89+, the same products in fp32 elsewhere
# ---------------------------------------------------------------------------

def scaled_mm_supported(device: torch.device) -> bool:
    """torch._scaled_mm with row-wise scales: CUDA compute capability 8.9 (Ada) or 9.x (Hopper)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(QuantizedLinearMethod):
    """y = x @ W.T for an Fp8Weight: torch._scaled_mm where the device has fp8 tensor cores,
    else the same products in fp32 (module header)."""

    def __init__(self, weight, device: torch.device):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = "fp8"
        self.activations = weight.activations
        self.register_buffer("qweight", weight.codes.to(device).contiguous())
        self.register_buffer("weight_scale", weight.scales.to(device=device, dtype=torch.float32).contiguous())
        self.register_buffer("input_scale", None if weight.input_scale is None
                             else weight.input_scale.to(device=device, dtype=torch.float32).reshape(1, 1))
        # _scaled_mm's fp8 GEMMs need K and N multiples of 16.
        self.use_scaled_mm = (scaled_mm_supported(device) and self.activations != "none"
                              and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    @property
    def takes_fp8_input(self) -> bool:
        """Codes from the op before are taken where they are multiplied as codes (_scaled_mm); the
        emulation quantizes floats itself. ROOFLM_FP8_FUSED_QUANT=0: never (the A/B switch)."""
        return self.use_scaled_mm and envs.cached.ROOFLM_FP8_FUSED_QUANT

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [M, K] e4m3, scale [M, 1] fp32) of the activations."""
        from rooflm.kernels.fp8_quant import per_token_fp8, static_fp8
        if self.activations == "static":
            return static_fp8(x, self.input_scale), self.input_scale.expand(x.shape[0], 1)
        return per_token_fp8(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.activations == "none":  # weight-only fp8: weights dequantized into x's dtype
            w = (self.qweight.to(torch.float32) * self.weight_scale[:, None]).to(x.dtype)
            y = flat @ w.T
        else:
            y = self.forward_fp8(*self.quantize_input(flat)).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_fp8(self, qx: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """bf16 (fp32 emulated) y [M, N] of codes qx [M, K] with scales sx [M, 1]."""
        if self.use_scaled_mm:
            try:
                # Row-wise scaling takes a row-major A, a column-major B (W.T of the row-major
                # [N, K] weight is one) and returns bf16. Fast accumulation: quant/fp8.py's header.
                return torch._scaled_mm(qx, self.qweight.t(), scale_a=sx.contiguous(),
                                        scale_b=self.weight_scale.reshape(1, -1), out_dtype=torch.bfloat16,
                                        use_fast_accum=envs.cached.ROOFLM_FP8_FAST_ACCUM)
            except RuntimeError as exc:
                # A torch build or shape without row-wise fp8 GEMMs: found at the first (eager,
                # warm-up) call, before any CUDA graph is captured; the emulation is slower, not wrong.
                logger.warning("torch._scaled_mm failed for fp8 linear %dx%d (%s); using the fp32 emulation",
                               self.out_features, self.in_features, exc)
                self.use_scaled_mm = False
        return fp8_matmul_emulated(qx, sx, self.qweight, self.weight_scale)


def fp8_matmul_emulated(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The reference of the W8A8 product, fp32: (qx * sx) @ (qw * sw).T. Every fp8 value is exact in
    fp32 and each product of two is too (4 + 4 mantissa bits), so only the sum's order differs
    from the tensor cores'."""
    return (qx.float() @ qw.float().T) * sx.float() * sw.float()[None, :]


def make_linear_method(weight, device: torch.device, act_dtype: torch.dtype) -> Optional[QuantizedLinearMethod]:
    """The module for any quantized weight (GGUF blocks, GroupWeight, ChannelWeight, Fp8Weight) on `device`,
    or None where no kernel here takes it (the caller then dequantizes)."""
    from rooflm.quant.formats import ChannelWeight, Fp8Weight, GroupWeight, from_gguf_blocks
    if isinstance(weight, BlockTensor):
        if device.type == "cuda":  # the Triton kernels, on the blocks' own values
            return make_linear_method(from_gguf_blocks(weight), device, act_dtype)
        return make_quantized_linear(weight, device)
    if isinstance(weight, Fp8Weight):  # every device: fp32 emulation where there is no _scaled_mm
        return Fp8Linear(weight, device)
    if device.type != "cuda":
        return None  # CPU: dequantized at load (no CPU kernel for these layouts yet)
    if isinstance(weight, GroupWeight):
        # The kernel's tiles hold whole groups: a short last group (K % g) is dequantized instead.
        g = weight.group_size
        if weight.shape[1] % g or g % 16 or g & (g - 1):
            return None
        if weight.bits == 8:
            return None if weight.perm is not None else W8A16Linear(weight, device, act_dtype)
        return W4A16Linear(weight, device, act_dtype)
    if isinstance(weight, ChannelWeight):
        return W8A16Linear(weight, device, act_dtype)
    raise TypeError(f"no linear method for {type(weight).__name__}")
