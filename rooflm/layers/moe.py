"""Mixture-of-experts parts: a router, the experts (stacked weights), a shared expert, and the
sparse MoE block that composes them in place of a dense MLP.

    x -> Router -> (topk_weights, topk_ids) -> Experts -> sum_k w * expert(x)  (+ SharedExpert(x)) -> out

Router (what each family computes; the softmax always in fp32):
  softmax       top-k of softmax(x W^T); with norm_topk_prob the k weights are divided by their
                sum (Mixtral always; Qwen3-MoE / OLMoE / Qwen2-MoE per config)
  softmax_topk  top-k of the logits x W^T + b, softmax over the k selected (gpt-oss)

Experts hold w13 [E, 2I, H] (gate rows then up rows: the fused kernel's layout) and w2 [E, H, I],
plus gpt-oss's biases b13 [E, 2I], b2 [E, H]. Activation "silu" (SwiGLU) or "swigluoai" (gpt-oss's
clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate)). Two paths: the fused Triton kernel on
CUDA (Kernels.fused_moe, rooflm/kernels/fused_moe.py) and the torch path here (a loop over the
experts that have tokens: the CPU path and the reference the fused one is tested against).

Tensor parallelism: like the dense MLP (Megatron's split), every rank holds every expert, with
the intermediate dimension split: rows [r I/N, (r+1) I/N) of gate and of up, the same columns of
down. Each rank's output is a partial sum and the block all-reduces once (experts and shared
expert together). The router is replicated: every rank routes alike.

Expert parallelism (--enable-expert-parallel, over the tensor-parallel ranks): rank r holds the
whole of experts [r E/N, (r+1) E/N) instead of 1/N of each. Attention stays tensor-parallel, so
every rank already has every token's hidden state: each rank runs the pairs routed to its own
experts (the others' ids become -1 and add nothing: local_expert_ids) and the block's one
all-reduce sums the ranks' parts, as under TP. This is the all-gather + reduce-scatter form of
EP with the gather free (TP's attention output is replicated); an all-to-all that moves only the
routed tokens pays off once attention is data-parallel (not built). The shared expert stays
tensor-parallel. Per step a rank reads its own active experts whole: at decode, the experts
touched split unevenly over the ranks (the imbalance `rooflm profile` shows: ExpertLoadCounter).

Load counting (ExpertLoadCounter, on only where the engine was built with count_expert_load, as
`rooflm profile` builds it): each block adds its step's routed (token, expert) pairs into a
device tensor [steps, layers, experts] ring, inside the CUDA graphs too; the host reads it only
when asked (between profiled passes), so a step never waits for it.

Weights come from HF checkpoints through SparseMoeBlock.load_weight, with names relative to the
block (the model strips "model.layers.{i}.mlp." or Mixtral's "...block_sparse_moe."):
  gate.weight                                         router (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE)
  experts.{e}.gate_proj|up_proj|down_proj.weight      per-expert (Qwen3-MoE, OLMoE, Qwen2-MoE)
  experts.{e}.w1|w3|w2.weight                         per-expert (Mixtral: w1 gate, w3 up, w2 down)
  experts.gate_up_proj, experts.down_proj             stacked (transformers 5's in-memory layout:
                                                      [E, 2I, H] gate;up and [E, H, I]; gpt-oss:
                                                      [E, H, 2I] gate/up interleaved and [E, I, H])
  experts.gate_up_proj_bias, experts.down_proj_bias   gpt-oss's biases (interleaved like its weight)
  router.weight, router.bias                          gpt-oss's router
  shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight    Qwen2-MoE
  shared_experts.{gate,up,down}_proj.weight           DeepSeek (no sigmoid gate)

Quantized checkpoints (GPTQ, AWQ, compressed-tensors int4/int8, FP8, GGUF): the loader hands an
expert's qweight / qzeros / scales / g_idx over as one rooflm.quant.formats weight under the float
name (experts.{e}.up_proj.weight). int4 group-wise weights (GroupWeight, bits 4) without act-order
stay int4 where the fused kernel runs (CUDA) and each rank holds whole experts (one rank, or expert
parallelism): packed codes with per-expert group scales and zeros (Experts.int4_group; the kernel's
W4A16 path). Everything else is dequantized as it is copied in (act-order undone), and the experts
run as float (FP8 again under --quantization fp8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from rooflm.kernels.fp8_quant import per_token_fp8_ref
from rooflm.layers.activation import silu_and_mul_torch
from rooflm.layers.kernels import TORCH_KERNELS, Kernels
from rooflm.quant.fp8 import quantize_fp8_experts
from rooflm.kernels.int4_pack import int4_split, pack_int4
from rooflm.quant.formats import GroupWeight, is_quantized_tensor

if TYPE_CHECKING:
    from rooflm.distributed.group import TPGroup


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert (HF's moe_intermediate_size where the family has one)
    norm_topk_prob: bool = False
    scoring: str = "softmax"  # or "softmax_topk" (gpt-oss)
    router_bias: bool = False
    router_fp32: bool = False  # the router's matmul in fp32 too (HF: in the model's dtype)
    expert_bias: bool = False
    activation: str = "silu"  # or "swigluoai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    gate_up_interleaved: bool = False  # gpt-oss's stacked checkpoint layout (load_weight)
    shared_expert_intermediate_size: int = 0  # 0: none
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid(x . g) on the shared expert; DeepSeek: none

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.scoring not in ("softmax", "softmax_topk"):
            raise ValueError(f"scoring must be 'softmax' or 'softmax_topk', got {self.scoring!r}")
        if self.activation not in ("silu", "swigluoai"):
            raise ValueError(f"activation must be 'silu' or 'swigluoai', got {self.activation!r}")

    @classmethod
    def from_hf(cls, hf) -> "MoeConfig":
        """From a transformers config of Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE or gpt-oss."""
        model_type = getattr(hf, "model_type", "")
        num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
        if not num_experts:
            raise ValueError(f"{model_type or type(hf).__name__}: config has no num_experts / num_local_experts")
        inter = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        common = dict(num_experts=num_experts, top_k=hf.num_experts_per_tok, hidden_size=hf.hidden_size,
                      intermediate_size=inter)
        if model_type == "gpt_oss":
            return cls(**common, scoring="softmax_topk", router_bias=True, expert_bias=True, activation="swigluoai",
                       swiglu_alpha=getattr(hf, "swiglu_alpha", 1.702), swiglu_limit=getattr(hf, "swiglu_limit", 7.0),
                       gate_up_interleaved=True)
        norm = True if model_type == "mixtral" else bool(getattr(hf, "norm_topk_prob", False))
        shared = getattr(hf, "shared_expert_intermediate_size", 0) or 0
        return cls(**common, norm_topk_prob=norm, shared_expert_intermediate_size=shared)


# ---- router --------------------------------------------------------------------------------

class Router(torch.nn.Module):
    """Top-k expert choice per token: (topk_weights fp32 [T, k], topk_ids [T, k]: int64 from
    torch, int32 from the one-launch kernel, Kernels.moe_router, which reads the matmul's
    logits in their dtype as fp32: the matmul and one launch on CUDA)."""

    def __init__(self, cfg: MoeConfig, kernel: Optional[Callable] = None):
        super().__init__()
        self.cfg = cfg
        self.kernel = kernel
        self.weight = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = torch.nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.router_fp32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)
        return F.linear(x, self.weight, self.bias).float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            logits = self.logits(x) if self.cfg.router_fp32 else F.linear(x, self.weight, self.bias)
            return self.kernel(logits, self.cfg.top_k, self.cfg.scoring, self.cfg.norm_topk_prob)
        logits = self.logits(x)
        if self.cfg.scoring == "softmax_topk":
            top, ids = torch.topk(logits, self.cfg.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


# ---- experts -------------------------------------------------------------------------------

def swigluoai_torch(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on [.., 2I] laid out gate;up (the loader de-interleaves)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                  b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                  w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum_k w[t, k] expert_{ids[t, k]}(x[t]): per expert with tokens, its rows' two matmuls,
    added into the output at its tokens (HF's loop; one host sync for the per-expert counts).
    With scales, w13 / w2 are FP8 codes (Experts.quantize_fp8) and each matmul is W8A8's."""
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat >= 0, flat, num_experts)  # -1 (another rank's expert): sorted last, skipped
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        if w13_scale is None:
            h = act(F.linear(x[tokens], w13[expert], None if b13 is None else b13[expert]))
            y = F.linear(h, w2[expert], None if b2 is None else b2[expert])
        else:
            h = act(_w8a8(x[tokens], w13[expert], w13_scale[expert], None if b13 is None else b13[expert])).to(x.dtype)
            y = _w8a8(h, w2[expert], w2_scale[expert], None if b2 is None else b2[expert])
        out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
    return out


def _w8a8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ W^T as FP8 W8A8 computes it, in fp32: x's per-token E4M3 codes times W's codes, scaled
    by both scales (the dense Fp8Linear's CPU numerics; the fused kernel's on CUDA)."""
    qx, sx = per_token_fp8_ref(x)
    y = (qx.float() @ codes.float().T) * sx * scales.float()
    return y if bias is None else y + bias.float()


def local_expert_ids(topk_ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Router ids -> this rank's expert indices under expert parallelism: id - first for the
    experts [first, first + count) held here, -1 for the others (their pairs add nothing here)."""
    local = topk_ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, -1))


class Experts(torch.nn.Module):
    """Every expert's gated MLP, stacked. Tensor parallel: this rank's share [start, start +
    I_local) of each expert's intermediate dimension. Expert parallel: the whole of this rank's
    experts [expert_start, expert_start + num_local). One rank: all of it."""

    def __init__(self, cfg: MoeConfig, kernel: Optional[Callable] = None, rank: int = 0, world: int = 1,
                 align: Optional[Callable] = None, expert_parallel: bool = False):
        super().__init__()
        self.expert_parallel = expert_parallel and world > 1
        if self.expert_parallel and cfg.num_experts % world:
            raise ValueError(f"--enable-expert-parallel: {cfg.num_experts} experts do not split evenly over "
                             f"{world} ranks")
        if not self.expert_parallel and cfg.intermediate_size % world:
            raise ValueError(f"moe intermediate_size {cfg.intermediate_size} is not divisible by "
                             f"the tensor-parallel size {world}")
        self.cfg = cfg
        self.kernel = kernel  # rooflm.kernels.fused_moe.fused_moe on CUDA (Kernels.fused_moe), else torch
        self.align = align  # Kernels.moe_align: the kernel's sort by expert; None: its default
        ep = world if self.expert_parallel else 1
        self.num_local = cfg.num_experts // ep
        self.expert_start = rank * self.num_local if self.expert_parallel else 0
        self.inter = cfg.intermediate_size // (1 if self.expert_parallel else world)
        self.start = 0 if self.expert_parallel else rank * self.inter
        self.is_driver = rank == 0
        e, h, i = self.num_local, cfg.hidden_size, self.inter
        self.w13 = torch.nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = torch.nn.Parameter(torch.empty(e, h, i))
        self.b13 = torch.nn.Parameter(torch.empty(e, 2 * i)) if cfg.expert_bias else None
        self.b2 = torch.nn.Parameter(torch.empty(e, h)) if cfg.expert_bias else None
        # FP8 experts (quantize_fp8): per-output-channel fp32 scales beside the E4M3 codes;
        # buffers, so .to() moves them and the runner's weight_bytes counts them
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        # int4 experts (an int4 checkpoint, _to_int4): the group size, 0 while the experts are float;
        # packed codes w13_q [E, 2I, S_H], w2_q [E, H, S_I] and scales / zeros [E, K/g, rows]
        self.int4_group = 0

    @property
    def quant_format(self) -> str:
        """"fp8" once quantize_fp8 ran, "int4" for an int4 checkpoint's experts, else "" (the
        weights in the model's dtype)."""
        if self.int4_group:
            return "int4"
        return "fp8" if self.w13_scale is not None else ""

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """`--quantization fp8` on a loaded block: w13 / w2 become E4M3 codes with one fp32 scale
        per output channel of each expert (the dense FP8 path's per-channel scheme); the forward
        then quantizes activations per token (W8A8). Biases stay in the model's dtype."""
        if self.w13_scale is not None:
            return
        if self.int4_group:
            raise ValueError("--quantization fp8 on int4 experts (an int4 checkpoint): they are already quantized")
        w13_codes, w13_scale = quantize_fp8_experts(self.w13.data)
        w2_codes, w2_scale = quantize_fp8_experts(self.w2.data)
        self.w13 = torch.nn.Parameter(w13_codes, requires_grad=False)
        self.w2 = torch.nn.Parameter(w2_codes, requires_grad=False)
        self.w13_scale = w13_scale
        self.w2_scale = w2_scale

    def weight_count(self) -> int:
        """Expert weights this rank holds (E x 3 x H x I_local), whatever their format."""
        return self.num_local * 3 * self.cfg.hidden_size * self.inter

    def stored_weight_bytes(self) -> int:
        """Bytes the expert weights hold as stored: bf16 codes, E4M3 codes plus their scales, or
        packed int4 codes plus their group scales and zeros."""
        if self.int4_group:
            tensors = [self.w13_q, self.w13_s, self.w13_z, self.w2_q, self.w2_s, self.w2_z]
        else:
            tensors = [self.w13, self.w2] + ([self.w13_scale, self.w2_scale] if self.w13_scale is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cfg.activation == "swigluoai":
            return swigluoai_torch(gate_up, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        return silu_and_mul_torch(gate_up)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        local_only = self.expert_parallel
        if local_only:
            topk_ids = local_expert_ids(topk_ids, self.expert_start, self.num_local)
        if self.kernel is not None:
            extra = {} if self.align is None else {"align": self.align}
            if local_only:
                extra["local_only"] = True
            if self.int4_group:
                extra.update(w13_scale=self.w13_s, w2_scale=self.w2_s, w13_zeros=self.w13_z, w2_zeros=self.w2_z,
                             group_size=self.int4_group)
                return self.kernel(x, self.w13_q, self.w2_q, topk_weights, topk_ids, b13=self.b13, b2=self.b2,
                                   activation=self.cfg.activation, alpha=self.cfg.swiglu_alpha,
                                   limit=self.cfg.swiglu_limit, **extra)
            if self.w13_scale is not None:
                extra.update(w13_scale=self.w13_scale, w2_scale=self.w2_scale)
            return self.kernel(x, self.w13, self.w2, topk_weights, topk_ids, b13=self.b13, b2=self.b2,
                               activation=self.cfg.activation, alpha=self.cfg.swiglu_alpha,
                               limit=self.cfg.swiglu_limit, **extra)
        return experts_torch(x, self.w13, self.w2, topk_weights, topk_ids, self.act, self.b13, self.b2,
                             self.w13_scale, self.w2_scale)

    # -- loading: checkpoint tensors, whole experts' rows; this rank keeps its share -----------

    def _rows(self, tensor, dim: int) -> torch.Tensor:
        """This rank's [start, start + I_local) along the intermediate dimension `dim`."""
        if tensor.shape[dim] != self.cfg.intermediate_size:
            raise ValueError(f"expert tensor of shape {tuple(tensor.shape)}: dim {dim} should be the "
                             f"intermediate size {self.cfg.intermediate_size}")
        return _narrow(tensor, dim, self.start, self.inter)

    def _local(self, tensor) -> torch.Tensor:
        """A stacked tensor's rows of this rank's experts (dim 0; all of them without EP)."""
        return _narrow(tensor, 0, self.expert_start, self.num_local)

    def load_expert(self, expert: int, proj: str, tensor) -> None:
        """One expert's HF linear weight: proj 'gate' / 'up' [I, H] or 'down' [H, I]. Under
        expert parallelism another rank's expert is skipped (that rank loads it)."""
        if not 0 <= expert < self.cfg.num_experts:
            raise ValueError(f"expert {expert} out of range [0, {self.cfg.num_experts})")
        expert -= self.expert_start
        if not 0 <= expert < self.num_local:
            return
        if self._keeps_int4(tensor):
            self._load_int4(expert, proj, tensor)
            return
        if self.int4_group:
            raise ValueError(f"expert {expert + self.expert_start} {proj}_proj: a {type(tensor).__name__} among int4 "
                             f"experts (group {self.int4_group}); a checkpoint mixing expert formats is not supported")
        with torch.no_grad():
            if proj == "down":
                _copy(self.w2[expert], self._rows(tensor, 1), f"expert {expert} down_proj")
            else:
                offset = 0 if proj == "gate" else self.inter
                _copy(self.w13[expert, offset:offset + self.inter], self._rows(tensor, 0), f"expert {expert} {proj}_proj")

    # -- int4 checkpoints kept as codes -----------------------------------------------------

    def _keeps_int4(self, tensor) -> bool:
        """Whether a checkpoint weight stays int4: a 4-bit GroupWeight without act-order, the
        fused kernel here to multiply it, whole experts on this rank, its group size the kernel
        takes (a power of two >= 16 dividing H and I) and the same as the experts already kept."""
        if not isinstance(tensor, GroupWeight) or tensor.bits != 4 or tensor.perm is not None:
            return False
        g = tensor.group_size
        if self.kernel is None or self.inter != self.cfg.intermediate_size or self.w13_scale is not None:
            return False
        if g < 16 or g & (g - 1) or self.cfg.hidden_size % g or self.inter % g:
            return False
        return self.int4_group in (0, g)

    def _to_int4(self, group: int) -> None:
        """The experts' storage becomes packed codes, group scales and zeros (the float stacks
        are dropped: only int4 weights load from here on)."""
        e, h, i = self.num_local, self.cfg.hidden_size, self.inter
        device, dtype = self.w13.device, self.w13.dtype
        self.register_buffer("w13_q", torch.zeros(e, 2 * i, int4_split(h, group), dtype=torch.uint8, device=device))
        self.register_buffer("w13_s", torch.zeros(e, h // group, 2 * i, dtype=dtype, device=device))
        self.register_buffer("w13_z", torch.zeros(e, h // group, 2 * i, dtype=dtype, device=device))
        self.register_buffer("w2_q", torch.zeros(e, h, int4_split(i, group), dtype=torch.uint8, device=device))
        self.register_buffer("w2_s", torch.zeros(e, i // group, h, dtype=dtype, device=device))
        self.register_buffer("w2_z", torch.zeros(e, i // group, h, dtype=dtype, device=device))
        self.w13 = torch.nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
        self.int4_group = group

    @torch.no_grad()
    def _load_int4(self, expert: int, proj: str, weight: "GroupWeight") -> None:
        if not self.int4_group:
            self._to_int4(weight.group_size)
        h, i = self.cfg.hidden_size, self.inter
        want = (h, i) if proj == "down" else (i, h)
        if tuple(weight.shape) != want:
            raise ValueError(f"expert {expert} {proj}_proj: checkpoint shape {tuple(weight.shape)}, the block "
                             f"expects {want}")
        packed = pack_int4(weight.codes, weight.group_size)
        if proj == "down":
            self.w2_q[expert].copy_(packed)
            self.w2_s[expert].copy_(weight.scales)
            self.w2_z[expert].copy_(weight.zeros)
            return
        rows = slice(0, i) if proj == "gate" else slice(i, 2 * i)
        self.w13_q[expert, rows].copy_(packed)
        self.w13_s[expert, :, rows].copy_(weight.scales)
        self.w13_z[expert, :, rows].copy_(weight.zeros)

    def load_stacked(self, name: str, tensor) -> None:
        """A stacked checkpoint tensor (transformers 5 / gpt-oss layouts, module docstring)."""
        t = self._local(_materialize(tensor))
        interleaved = self.cfg.gate_up_interleaved
        with torch.no_grad():
            if name == "gate_up_proj":
                # -> [E, 2I, H] gate;up. gpt-oss stores x @ W ([E, H, 2I]) with gate/up alternating.
                if interleaved:
                    t = t.transpose(1, 2)
                    gate, up = t[:, 0::2], t[:, 1::2]
                else:
                    gate, up = t.chunk(2, dim=1)
                _copy(self.w13[:, :self.inter], self._rows(gate, 1), name)
                _copy(self.w13[:, self.inter:], self._rows(up, 1), name)
            elif name == "down_proj":
                _copy(self.w2, self._rows(t.transpose(1, 2) if interleaved else t, 2), name)
            elif name == "gate_up_proj_bias" and self.b13 is not None:
                gate, up = (t[:, 0::2], t[:, 1::2]) if interleaved else t.chunk(2, dim=1)
                _copy(self.b13[:, :self.inter], self._rows(gate, 1), name)
                _copy(self.b13[:, self.inter:], self._rows(up, 1), name)
            elif name == "down_proj_bias" and self.b2 is not None:
                # Added once: rank 0 holds it, the others zeros, and the all-reduce sums them (under
                # expert parallelism each rank's experts are its own: their biases whole).
                _copy(self.b2, t if self.is_driver or self.expert_parallel else torch.zeros_like(t), name)
            else:
                raise KeyError(f"experts.{name}: not a stacked expert tensor this config has")


# ---- shared expert -------------------------------------------------------------------------

class SharedExpert(torch.nn.Module):
    """A dense gated MLP every token goes through (Qwen2-MoE's shared_expert, scaled by
    sigmoid(x . g); DeepSeek's shared_experts, unscaled). Sharded like the experts."""

    def __init__(self, cfg: MoeConfig, rank: int = 0, world: int = 1):
        super().__init__()
        size = cfg.shared_expert_intermediate_size
        if size % world:
            raise ValueError(f"shared_expert_intermediate_size {size} is not divisible by the tensor-parallel size {world}")
        self.full = size
        self.inter = size // world
        self.start = rank * self.inter
        self.gate_up = torch.nn.Parameter(torch.empty(2 * self.inter, cfg.hidden_size))
        self.down = torch.nn.Parameter(torch.empty(cfg.hidden_size, self.inter))
        self.gate = torch.nn.Parameter(torch.empty(1, cfg.hidden_size)) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(silu_and_mul_torch(F.linear(x, self.gate_up)), self.down)
        if self.gate is not None:
            y = torch.sigmoid(F.linear(x, self.gate)) * y
        return y

    def load(self, proj: str, tensor) -> None:
        with torch.no_grad():
            if proj == "down":
                _copy(self.down, _narrow(tensor, 1, self.start, self.inter), "shared expert down_proj")
            elif proj in ("gate", "up"):
                offset = 0 if proj == "gate" else self.inter
                _copy(self.gate_up[offset:offset + self.inter], _narrow(tensor, 0, self.start, self.inter),
                      f"shared expert {proj}_proj")
            else:
                raise KeyError(f"shared expert has no {proj}_proj")

    def load_gate(self, tensor) -> None:
        if self.gate is None:
            raise KeyError("shared_expert_gate.weight: this config's shared expert has no gate")
        with torch.no_grad():
            _copy(self.gate, _materialize(tensor), "shared_expert_gate")


# ---- the block -----------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_SHARED = re.compile(r"^shared_experts?\.(gate_proj|up_proj|down_proj)\.weight$")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


class SparseMoeBlock(torch.nn.Module):
    """x [..., H] -> router -> experts (+ shared expert) -> [..., H]; one all-reduce under TP."""

    def __init__(self, cfg: MoeConfig, kernels: Kernels = TORCH_KERNELS, tp: Optional["TPGroup"] = None,
                 expert_parallel: bool = False):
        super().__init__()
        rank, world = (0, 1) if tp is None else (tp.rank, tp.size)
        self.cfg = cfg
        # attach_expert_load_counter: the counter this block adds its routing to, and its row
        self.load_counter: Optional[ExpertLoadCounter] = None
        self.load_layer = 0
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.router = Router(cfg, kernels.moe_router)
        self.experts = Experts(cfg, kernels.fused_moe, rank, world, kernels.moe_align, expert_parallel)
        self.shared_expert = SharedExpert(cfg, rank, world) if cfg.shared_expert_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_weights, topk_ids = self.router(x)
        if self.load_counter is not None:
            self.load_counter.add(self.load_layer, topk_ids)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out.reshape(shape)

    def load_weight(self, name: str, tensor) -> tuple[str, ...]:
        """Take one HF checkpoint tensor named relative to the block (module docstring). Returns
        the pieces of weight_pieces() it filled, for the model loader's missing-tensor check."""
        match = _PER_EXPERT.match(name)
        if match:
            proj = _PROJ[match.group(2)]
            self.experts.load_expert(int(match.group(1)), proj, tensor)
            return (f"experts.{int(match.group(1))}.{proj}",)
        match = _SHARED.match(name)
        if match and self.shared_expert is not None:
            self.shared_expert.load(_PROJ[match.group(1)], tensor)
            return (f"shared_expert.{_PROJ[match.group(1)]}",)
        if name in ("gate.weight", "router.weight"):
            with torch.no_grad():
                _copy(self.router.weight, _materialize(tensor), name)
            return ("router.weight",)
        if name == "router.bias" and self.router.bias is not None:
            with torch.no_grad():
                _copy(self.router.bias, _materialize(tensor), name)
            return ("router.bias",)
        if name == "shared_expert_gate.weight" and self.shared_expert is not None:
            self.shared_expert.load_gate(tensor)
            return ("shared_expert_gate",)
        if name.startswith("experts.") and name.count(".") == 1:
            stacked = name[len("experts."):]
            self.experts.load_stacked(stacked, tensor)
            experts = range(self.cfg.num_experts)
            if stacked == "gate_up_proj":
                return tuple(f"experts.{e}.{p}" for e in experts for p in ("gate", "up"))
            if stacked == "down_proj":
                return tuple(f"experts.{e}.down" for e in experts)
            return (f"experts.{stacked}",)
        raise KeyError(f"{name}: not a weight of this MoE block")

    def weight_pieces(self) -> tuple[str, ...]:
        """Everything load_weight must fill, one name per per-expert checkpoint tensor's worth:
        the router, each expert's gate, up and down, the stacked biases, the shared expert's."""
        pieces = ["router.weight"] + (["router.bias"] if self.router.bias is not None else [])
        for e in range(self.cfg.num_experts):
            pieces += [f"experts.{e}.gate", f"experts.{e}.up", f"experts.{e}.down"]
        if self.experts.b13 is not None:
            pieces += ["experts.gate_up_proj_bias", "experts.down_proj_bias"]
        if self.shared_expert is not None:
            pieces += ["shared_expert.gate", "shared_expert.up", "shared_expert.down"]
            if self.shared_expert.gate is not None:
                pieces.append("shared_expert_gate")
        return tuple(pieces)


# ---- load counting -------------------------------------------------------------------------

class ExpertLoadCounter:
    """Tokens routed to each expert, per MoE layer and step, counted on the device.

    counts [layers, history, experts] int32 keeps the last `history` steps (a ring): begin_step
    clears the step's slot and marks which of the step's token rows are real (a CUDA graph's
    batch is padded to its captured size; the padding rows route too, and are not counted).
    Both are device tensors written in place, so the captured graphs read the current step's
    values; nothing waits for the host, and a block's count is two launches (the index, the
    index_add). Forwards outside a step (the memory profile, graph capture) count nothing:
    no row is real until the first step."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, device, max_tokens: int,
                 history: int = 256, names: tuple[str, ...] = ()):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.history = history
        self.names = names or tuple(str(i) for i in range(num_layers))  # the blocks' module names
        self.counts = torch.zeros(num_layers, history, num_experts, dtype=torch.int32, device=device)
        # 1 for the step's real rows, as the index_add's source: [rows, top_k], read flat
        self.real = torch.zeros(max_tokens, top_k, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros((), dtype=torch.int64, device=device)  # for longer forwards
        self.offset = torch.zeros((), dtype=torch.int64, device=device)  # the slot's first index
        self.steps = 0  # steps begun since start (host-side: the ring's position)

    def begin_step(self, num_tokens: int) -> None:
        slot = self.steps % self.history
        self.counts[:, slot].zero_()
        self.offset.fill_(slot * self.num_experts)
        self.real.zero_()
        self.real[:num_tokens].fill_(1)
        self.num_tokens.fill_(num_tokens)
        self.steps += 1

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        tokens, k = topk_ids.shape
        if tokens <= self.real.shape[0]:
            real = self.real[:tokens].view(-1)
        else:  # more rows than the runner said a step has: mask them here
            rows = torch.arange(tokens, device=topk_ids.device) < self.num_tokens
            real = rows.to(torch.int32).unsqueeze(1).expand(tokens, k).reshape(-1)
        self.counts[layer].view(-1).index_add_(0, (topk_ids + self.offset).view(-1), real)

    def recent(self, steps: int) -> torch.Tensor:
        """The last min(steps, history, steps begun) steps' counts, oldest first, on the host
        [steps, layers, experts] (a device sync: call it between steps, not in one)."""
        steps = min(steps, self.history, self.steps)
        slots = [(self.steps - steps + i) % self.history for i in range(steps)]
        return self.counts[:, slots].transpose(0, 1).cpu()


def attach_expert_load_counter(model: torch.nn.Module, device, max_tokens: int) -> Optional[ExpertLoadCounter]:
    """One counter for every SparseMoeBlock of `model`, rows in module order; None without any.
    max_tokens: the most token rows a forward has (graph padding included)."""
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    if not named:
        return None
    names, blocks = zip(*named)
    cfg = blocks[0].cfg
    counter = ExpertLoadCounter(len(blocks), cfg.num_experts, cfg.top_k, device, max_tokens, names=names)
    for row, block in enumerate(blocks):
        block.load_counter = counter
        block.load_layer = row
    return counter


def hub_tensors(cfg: MoeConfig, params: dict[str, torch.Tensor],
                projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
    """A whole (one-rank) block's parameters, named as SparseMoeBlock.named_parameters() names
    them, as the per-expert (gpt-oss: stacked) checkpoint tensors load_weight takes back: (name relative to the
    block, tensor view). projs: the family's names of an expert's gate, up and down (Mixtral:
    w1, w3, w2). Dummy checkpoints and the loader's expected shapes (hub_shapes) come from here."""
    gate, up, down = projs
    inter, experts = cfg.intermediate_size, cfg.num_experts
    yield ("router.weight" if cfg.scoring == "softmax_topk" else "gate.weight"), params["router.weight"]
    if cfg.router_bias:
        yield "router.bias", params["router.bias"]
    w13, w2 = params["experts.w13"], params["experts.w2"]
    if cfg.gate_up_interleaved:  # gpt-oss's checkpoints: stacked, x @ W, gate and up columns alternating
        gate_up = torch.stack((w13[:, :inter], w13[:, inter:]), dim=2).reshape(experts, 2 * inter, -1)
        yield "experts.gate_up_proj", gate_up.transpose(1, 2)
        yield "experts.down_proj", w2.transpose(1, 2)
    for e in range(0 if cfg.gate_up_interleaved else experts):
        yield f"experts.{e}.{gate}.weight", w13[e, :inter]
        yield f"experts.{e}.{up}.weight", w13[e, inter:]
        yield f"experts.{e}.{down}.weight", w2[e]
    if cfg.expert_bias:
        b13 = params["experts.b13"]
        if cfg.gate_up_interleaved:
            b13 = torch.stack((b13[:, :inter], b13[:, inter:]), dim=-1).reshape(experts, 2 * inter)
        yield "experts.gate_up_proj_bias", b13
        yield "experts.down_proj_bias", params["experts.b2"]
    if cfg.shared_expert_intermediate_size:
        size, gate_up = cfg.shared_expert_intermediate_size, params["shared_expert.gate_up"]
        yield "shared_expert.gate_proj.weight", gate_up[:size]
        yield "shared_expert.up_proj.weight", gate_up[size:]
        yield "shared_expert.down_proj.weight", params["shared_expert.down"]
        if cfg.shared_expert_gate:
            yield "shared_expert_gate.weight", params["shared_expert.gate"]


def hub_shapes(cfg: MoeConfig, projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
               ) -> dict[str, tuple[int, ...]]:
    """The per-expert checkpoint's tensor shapes of one block, names relative to it."""
    with torch.device("meta"):
        params = dict(SparseMoeBlock(cfg).named_parameters())
    return {name: tuple(t.shape) for name, t in hub_tensors(cfg, params, projs)}


# ---- helpers -------------------------------------------------------------------------------

def _materialize(tensor) -> torch.Tensor:
    """A tensor, a lazy checkpoint slice (model/loader.LazySlice) read whole, or a quantized
    checkpoint weight (GPTQ / AWQ / compressed-tensors int4 or int8, FP8, GGUF blocks: the
    rooflm.quant.formats runtime forms) dequantized to fp32, act-order permutation undone: the
    experts keep float weights (the module docstring's "Quantized checkpoints")."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    if is_quantized_tensor(tensor):
        return tensor.dequantize()
    return tensor.load()


def _narrow(tensor, dim: int, start: int, size: int) -> torch.Tensor:
    """tensor.narrow; a lazy slice reads only those rows or columns."""
    if start == 0 and size == tensor.shape[dim]:
        return _materialize(tensor)
    if is_quantized_tensor(tensor):
        return _materialize(tensor).narrow(dim, start, size)
    return tensor.narrow(dim, start, size)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)}, the block expects {tuple(dst.shape)}")
    dst.copy_(src)
