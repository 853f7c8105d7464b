"""The decoder every family is built from: parts chosen by a ModelSpec (model/spec.py), and the
fast paths that belong to those parts.

A family file (model/llama.py, model/olmo2.py, model/gemma2.py, ...) maps its config to a
ModelSpec and subclasses CausalLM; nothing here looks at the family again. What a family
changes is a choice of parts: norms before and/or after each sublayer, w * norm(x) or
(1 + w) * norm(x), q/k norms per head or over the projection, a score scale and soft-cap, a
window per layer, a scaled embedding, a SiLU or GELU-tanh gated MLP or a sparse MoE block
(per layer: ModelSpec.layer_mlps), soft-capped logits.

The model consumes a packed step: input_ids and positions of every scheduled token, one
KVCache per layer, and the step's AttentionMetadata. Parameter names follow the checkpoint's,
so its tensors map onto them by name.

Fast paths, each taken where the parts it fuses are present and falling back per part:
  * one token, float weights (Kernels.gemv): the layer as four weight GEMVs, the pre-norms
    folded into the GEMV that reads their output, the residual adds into the GEMV epilogues
    (a post-norm sits between: it runs apart, then the add), SiLU-mul into gate_up's;
  * one token, quantized weights that fold (W4A16's mma kernel): the same folds inside the
    quantized kernels (_forward_folded);
  * FP8 W8A8 linears: the pre-norms and the SiLU-mul write E4M3 codes themselves (_forward_fp8);
  * everything else: the residual stream carried beside the hidden state, so each pre-norm
    fuses the add before it (the Triton RMSNorm on CUDA).
A (1 + w) norm joins every fold through its fused_weight (1 + w in fp32). An MoE block has no
fused form in these paths: the attention half keeps its own and the block runs as itself (router,
then the experts: Kernels.fused_moe on CUDA), its pre-norm and residual add apart. The native C decoder
(quant/native_decode.py) computes the Llama layer: it takes the layers whose spec is that one.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional

import torch

from rooflm.config import ModelConfig
from rooflm.distributed import layers as tp_layers
from rooflm.distributed.group import SINGLE, TPGroup
from rooflm.distributed.pipeline import StageLayout
from rooflm.layers.activation import GeluTanhAndMul, SiluAndMul
from rooflm.layers.attention import (Attention, AttentionBackend, AttentionMetadata, ReferenceBackend, SinkAttention,
                                    SoftcappedAttention)
from rooflm.layers.kernels import TORCH_KERNELS, Kernels
from rooflm.layers.kv_cache import KVCache
from rooflm.layers.linear import FusedLinear, Linear
from rooflm.layers.moe import SparseMoeBlock, hub_tensors
from rooflm.layers.norm import OnePlusRMSNorm, RMSNorm
from rooflm.layers.rotary import RotaryEmbedding, shared_rotaries
from rooflm.model.spec import DENSE, MOE, QK_NORM_HEAD, QK_NORM_PROJ, RMS, SILU, ModelSpec
from rooflm.quant.formats import is_quantized_tensor
from rooflm.quant.linear_method import make_linear_method
from rooflm.quant.native_decode import NativeDecoder

log = logging.getLogger(__name__)


def make_norm(spec: ModelSpec, size: int, eps: float, kernel=None) -> RMSNorm:
    """The family's norm over `size` features."""
    if spec.norm == RMS:
        return RMSNorm(size, eps, kernel)
    return OnePlusRMSNorm(size, eps, kernel)


class DecoderAttention(torch.nn.Module):
    """Fused q/k/v projection, the spec's q/k norm, attention over the paged cache, o_proj."""

    def __init__(self, cfg: ModelConfig, spec: ModelSpec, window: Optional[int], rotary: RotaryEmbedding,
                 backend: Optional[AttentionBackend], kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg = cfg
        # This rank's heads (all of them on one device): q/k/v are column-parallel by head,
        # o_proj row-parallel, so attention itself needs no communication.
        self.heads = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
        self.qkv_proj = tp_layers.qkv_linear(cfg.hidden_size, self.heads, cfg.head_dim, cfg.attention_bias, tp,
                                             kernels.linear)
        self.o_proj = tp_layers.row_linear(cfg.q_size, cfg.hidden_size, tp, kernels.linear, bias=spec.o_proj_bias)
        self.qk_norm = spec.qk_norm
        eps = cfg.rms_norm_eps
        if spec.qk_norm == QK_NORM_HEAD:  # over each head ([T, H, D]): torch, or Kernels.head_norm
            self.q_norm = make_norm(spec, cfg.head_dim, eps, kernels.head_norm)
            self.k_norm = make_norm(spec, cfg.head_dim, eps, kernels.head_norm)
        elif spec.qk_norm == QK_NORM_PROJ:
            if tp.size > 1:  # the mean of squares would need every rank's heads: one more all-reduce
                raise ValueError("q/k norms over the whole projection (OLMo 2) do not run with "
                                 "tensor_parallel_size > 1 yet")
            self.q_norm = make_norm(spec, cfg.q_size, eps, kernels.rmsnorm)
            self.k_norm = make_norm(spec, cfg.kv_size, eps, kernels.rmsnorm)
        heads = (self.heads.num_heads, self.heads.num_kv_heads, cfg.head_dim, rotary)
        # gpt-oss's sink logits, one per query head of this rank (checkpoint: self_attn.sinks).
        self.sinks = torch.nn.Parameter(torch.empty(self.heads.num_heads)) if spec.attn_sinks else None
        if spec.attn_softcap is not None and spec.attn_sinks:
            raise ValueError("attention with both soft-capping and sinks has no backend form")
        if spec.attn_softcap is not None:
            self.attn = SoftcappedAttention(*heads, spec.attn_softcap, window, backend, spec.attn_scale)
        elif spec.attn_sinks:
            self.attn = SinkAttention(*heads, window, backend, spec.attn_scale)
        else:
            self.attn = Attention(*heads, window, backend, spec.attn_scale)

    def checkpoint_shard(self, param_kind: str, tensor) -> torch.Tensor:
        """This rank's sinks: those of its query heads (the module's one parameter of its own)."""
        if param_kind != "sinks":
            raise ValueError(f"self_attn.{param_kind}: not a parameter of the attention block")
        return tp_layers.narrow(tensor, 0, self.heads.first_head, self.heads.num_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), kv_cache, meta))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: KVCache,
               meta: AttentionMetadata) -> torch.Tensor:
        """Fused q/k/v projections [T, q + 2 kv] -> attention output [T, q_size], before o_proj."""
        heads, head_dim = self.heads, self.cfg.head_dim
        t = qkv.shape[0]
        q_size, kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm == QK_NORM_PROJ:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, heads.num_heads, head_dim)
        k = k.reshape(t, heads.num_kv_heads, head_dim)
        v = v.view(t, heads.num_kv_heads, head_dim)
        if self.qk_norm == QK_NORM_HEAD:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.sinks is not None:
            return self.attn(positions, q, k, v, kv_cache, meta, sinks=self.sinks)
        return self.attn(positions, q, k, v, kv_cache, meta)


class GatedMLP(torch.nn.Module):
    """down(act(gate) * up): SiLU (Llama) or GELU-tanh (Gemma). Column-parallel gate/up,
    row-parallel down: one all-reduce for the MLP."""

    def __init__(self, cfg: ModelConfig, spec: ModelSpec, kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = tp_layers.merged_column_linear(
            cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}, tp, kernels.linear)
        self.down_proj = tp_layers.row_linear(cfg.intermediate_size, cfg.hidden_size, tp, kernels.linear)
        # Whether the fused SiLU-mul forms (quantized gate_up, FP8 codes) compute act; the GEMV's
        # gated epilogue computes either (act_name).
        self.silu = spec.mlp_act == SILU
        self.act_name = spec.mlp_act
        self.act = SiluAndMul(kernels.silu_mul) if self.silu else GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A quantized gate_up may apply SiLU-mul in its own kernel (W4A16 at small M: one launch
        # fewer, gate_up never written); None: the two ops.
        h = self.gate_up_proj.forward_silu_mul(x) if self.silu else None
        return self.down_proj(h if h is not None else self.act(self.gate_up_proj(x)))


def _pre(norm: Optional[RMSNorm], x: torch.Tensor, residual: Optional[torch.Tensor]):
    """(sublayer input, residual stream) from the layer's input x and the stream so far: the
    pre-norm fuses the add; a family without one feeds the stream itself (OLMo 2)."""
    if norm is None:
        h = x if residual is None else x + residual
        return h, h
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class DecoderLayer(torch.nn.Module):
    """h + post_attn(attn(pre_attn(h))), then the same around the MLP; an absent norm is the
    identity. The norms are registered under their checkpoint names (ModelSpec's), so the
    weights load by name; they are reached here by place (pre_attn, post_attn, ...)."""

    def __init__(self, cfg: ModelConfig, spec: ModelSpec, window: Optional[int], rotary: RotaryEmbedding,
                 backend: Optional[AttentionBackend], kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE,
                 mlp: str = DENSE, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, spec, window, rotary, backend, kernels, tp)
        # mlp: this layer's MLP part (ModelSpec.layer_mlps). The fast paths below fuse a dense
        # gated MLP; an MoE block runs as itself in every path (_mlp_apart, _mlp_sublayer).
        self.dense_mlp = mlp == DENSE
        self.mlp = (GatedMLP(cfg, spec, kernels, tp) if self.dense_mlp
                    else SparseMoeBlock(spec.moe, kernels, tp, expert_parallel))
        self.norm_names = (spec.pre_attn_norm, spec.post_attn_norm, spec.pre_mlp_norm, spec.post_mlp_norm)
        for name in self.norm_names:
            if name is not None:
                self.add_module(name, make_norm(spec, cfg.hidden_size, cfg.rms_norm_eps, kernels.rmsnorm))
        # On CUDA (rooflm.kernels.gemv.gemv): one-token steps run the layer as four weight GEMVs.
        self.gemv = kernels.gemv
        # Quantized linears may fold the same neighbours into their own kernels (one rank only:
        # a row-parallel layer's partial sums must be reduced before the residual add).
        self.fold = tp.size == 1
        # FP8 codes written by the norms and SiLU-mul need both pre-norms and SiLU.
        self.fp8_fusable = (self.fold and None not in (spec.pre_attn_norm, spec.pre_mlp_norm)
                            and (not self.dense_mlp or self.mlp.silu))
        # quant/native_decode.py: why the C decoder cannot compute this layer's parts, or None.
        self.native_reason = spec.native_reason()
        # Each sublayer's output times this before its residual add (Granite), or None.
        self.residual_scale = spec.residual_scale
        # --enable-lora: the step's token -> adapter slot map (rooflm/lora/mapping.py), which the
        # hooks on this layer's linears read; None without LoRA.
        self.lora_mapping = None

    def _norm(self, place: int) -> Optional[RMSNorm]:
        name = self.norm_names[place]
        return None if name is None else getattr(self, name)

    pre_attn = property(lambda self: self._norm(0))
    post_attn = property(lambda self: self._norm(1))
    pre_mlp = property(lambda self: self._norm(2))
    post_mlp = property(lambda self: self._norm(3))

    def _post(self, place: int, y: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as its residual add takes it: post-normed and scaled where the spec says."""
        norm = self._norm(place)
        if norm is not None:
            y = norm(y)
        return y if self.residual_scale is None else y * self.residual_scale

    def _add_post(self, place: int, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + post(y) for the one-token paths: a post-norm and its add in one kernel (RMSNorm.add_to)."""
        norm = self._norm(place)
        if norm is not None and self.residual_scale is None:
            return norm.add_to(y, h)
        return h + self._post(place, y)

    def _has_post(self, place: int) -> bool:
        """Whether something sits between a sublayer's last linear and its residual add."""
        return self.norm_names[place] is not None or self.residual_scale is not None

    def forward(self, positions, x, residual, kv_cache, meta):
        # A step with LoRA adapters: the one-token GEMV chain takes each hook's shrink beside its
        # GEMV and the delta in the GEMV's epilogue (LoRALinearHook.gemv_epilogue); the folded
        # and FP8-code forms have no such epilogue, and such steps take the plain path, where
        # the hooks sit in Linear.forward.
        fused = self.lora_mapping is None or not self.lora_mapping.active
        if self.gemv is not None and x.shape[0] == 1:
            return self._forward_gemv(positions, x, residual, kv_cache, meta, lora=not fused)
        if fused and self.fold and x.shape[0] == 1:
            folded = self._forward_folded(positions, x, residual, kv_cache, meta)
            if folded is not None:
                return folded
        if fused and self.fp8_fusable and self._fp8_inputs():
            return self._forward_fp8(positions, x, residual, kv_cache, meta)
        # The residual stream is carried separately so each pre-norm can fuse the add before it.
        x, residual = _pre(self.pre_attn, x, residual)
        x = self._post(1, self.self_attn(positions, x, kv_cache, meta))
        return self._mlp_sublayer(x, residual)

    def _mlp_sublayer(self, x, residual):
        """forward's second half, the residual stream carried beside x: post(mlp(pre(...)))."""
        x, residual = _pre(self.pre_mlp, x, residual)
        return self._post(3, self.mlp(x)), residual

    def _mlp_apart(self, h):
        """h + post(mlp(pre(h))) for the one-token paths, whose residual stream h is whole, where
        the MLP part has no fused form there (an MoE block; GELU-tanh's quantized gate_up)."""
        return self._add_post(3, self.mlp(self.pre_mlp(h) if self.pre_mlp is not None else h), h)

    # ---- one token, float weights: four GEMVs ----------------------------------------------

    def _forward_gemv(self, positions, x, residual, kv_cache, meta, lora: bool = False):
        """One token: forward's math (and casts) in four fused GEMVs. The residual stream h is
        returned whole (residual None): the adds happen in the GEMV epilogues. lora: the step
        has adapters; each targeted GEMV adds its hook's delta in its epilogue."""
        attn, mlp = self.self_attn, self.mlp
        h = x if residual is None else x + residual
        qkv = self._gemv_in(h, attn.qkv_proj, self.pre_attn, lora=lora)
        h = self._gemv_out(attn.attend(positions, qkv, kv_cache, meta), attn.o_proj, 1, h, lora)
        if not self.dense_mlp:
            return self._mlp_apart(h), None
        act = self._gemv_in(h, mlp.gate_up_proj, self.pre_mlp, gated=True, act=mlp.act_name, lora=lora)
        return self._gemv_out(act, mlp.down_proj, 3, h, lora), None

    def _gemv_in(self, h, linear: Linear, norm: Optional[RMSNorm], gated: bool = False,
                 act: str = SILU, lora: bool = False) -> torch.Tensor:
        """W @ norm(h) with the norm folded into the GEMV's load of h (no norm: W @ h); gated: the
        MLP's act(gate) * up in its epilogue; lora: the adapter delta before that epilogue."""
        kw = dict(gated=True, act=act) if gated else {}
        if norm is not None:
            kw.update(norm_weight=norm.fused_weight, eps=norm.eps)
        if lora and linear.lora is not None:
            kw["lora"] = linear.lora.gemv_epilogue(h, kw.get("norm_weight"), kw.get("eps", 1e-6))
        return self.gemv(h, linear.weight, bias=linear.bias, **kw)

    def _gemv_out(self, a, linear: Linear, place: int, h, lora: bool = False) -> torch.Tensor:
        """h + post(W @ a): the add in the GEMV epilogue where nothing sits between (_has_post)."""
        epilogue = linear.lora.gemv_epilogue(a) if lora and linear.lora is not None else None
        if not self._has_post(place):
            return _row_gemv(self.gemv, a, linear, h, epilogue)
        return self._add_post(place, _row_gemv(self.gemv, a, linear, None, epilogue), h)

    # ---- one token, quantized weights that fold ----------------------------------------------

    def _forward_folded(self, positions, x, residual, kv_cache, meta):
        """One token through quantized linears that take the norms and residual adds into their
        kernels (W4A16's mma kernel: NORM, RESIDUAL, GATED): forward's math and casts, no norm
        launches; the residual stream h is returned whole (residual None), as _forward_gemv does.
        None, with nothing computed, where qkv's method cannot fold; a later linear that cannot
        runs its neighbours apart."""
        attn, mlp = self.self_attn, self.mlp
        if not getattr(attn.qkv_proj.quant, "can_fold", False):
            return None
        h = x if residual is None else x + residual
        pre_attn, pre_mlp = self.pre_attn, self.pre_mlp
        qkv = _folded_in(attn.qkv_proj, h, pre_attn)
        if qkv is None:
            return None
        h = self._folded_out(attn.o_proj, attn.attend(positions, qkv, kv_cache, meta), 1, h)
        act = None
        if self.dense_mlp and mlp.silu:
            weight = _fold_weight(pre_mlp, h)
            if weight is not None or pre_mlp is None:
                act = mlp.gate_up_proj.forward_silu_mul(h, norm_weight=weight, eps=pre_mlp.eps if pre_mlp else 1e-6)
        if act is None:
            return self._mlp_apart(h), None
        return self._folded_out(mlp.down_proj, act, 3, h), None

    def _folded_out(self, linear: Linear, a: torch.Tensor, place: int, h: torch.Tensor) -> torch.Tensor:
        """h + post(W @ a): the add folded into the kernel where nothing sits between (_has_post)."""
        if not self._has_post(place):
            out = linear.forward_folded(a, residual=h)
            return out if out is not None else linear(a) + h
        return self._add_post(place, linear(a), h)

    # ---- FP8 W8A8: norms and SiLU-mul write the codes -----------------------------------------

    def _fp8_inputs(self) -> bool:
        """Whether qkv, gate_up and down take E4M3 codes from the norm / SiLU-mul before them
        (qkv alone before an MoE block, which runs as itself)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, mlp.gate_up_proj, mlp.down_proj) if self.dense_mlp else (attn.qkv_proj,)
        return all(lin.fp8_input() is not None for lin in linears)

    def _forward_fp8(self, positions, x, residual, kv_cache, meta):
        """forward for FP8 W8A8 linears: the pre-norms and the SiLU-mul write E4M3 codes and scales
        (per token, or the linear's static input scale) in their own kernels, so the bf16 inputs
        of qkv, gate_up and down are never written and no quantization pass reads them. The same
        codes as forward's (kernels/norm_act_fp8.py: bit for bit). o_proj quantizes its own input;
        post-norms run between, as in forward."""
        from rooflm.kernels.norm_act_fp8 import rmsnorm_fp8, silu_mul_fp8  # Triton: imported where used
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.pre_attn, self.pre_mlp
        qkv_q = attn.qkv_proj.fp8_input()
        if residual is None:
            residual = x
            qx, sx = rmsnorm_fp8(x, ln1.fused_weight, ln1.eps, static_scale=qkv_q.input_scale)
        else:
            qx, sx, residual = rmsnorm_fp8(x, ln1.fused_weight, ln1.eps, residual, static_scale=qkv_q.input_scale)
        qkv = attn.qkv_proj.forward_fp8(qx, sx, x.dtype)
        x = self._post(1, attn.o_proj(attn.attend(positions, qkv, kv_cache, meta)))
        if not self.dense_mlp:
            return self._mlp_sublayer(x, residual)
        down_q = mlp.down_proj.fp8_input()
        qx, sx, residual = rmsnorm_fp8(x, ln2.fused_weight, ln2.eps, residual,
                                       static_scale=mlp.gate_up_proj.fp8_input().input_scale)
        qa, sa = silu_mul_fp8(mlp.gate_up_proj.forward_fp8(qx, sx, x.dtype), static_scale=down_q.input_scale)
        return self._post(3, mlp.down_proj.forward_fp8(qa, sa, x.dtype)), residual


def _fold_weight(norm: Optional[RMSNorm], x: torch.Tensor) -> Optional[torch.Tensor]:
    """The norm's weight in the form a quantized kernel folds (x's dtype), or None."""
    if norm is None:
        return None
    weight = norm.fused_weight
    return weight if weight.dtype == x.dtype else None


def _folded_in(linear: Linear, h: torch.Tensor, norm: Optional[RMSNorm]) -> Optional[torch.Tensor]:
    """W @ norm(h) in one quantized kernel, the norm apart where it cannot fold; None: no fold."""
    weight = _fold_weight(norm, h)
    if norm is None or weight is not None:
        return linear.forward_folded(h, norm_weight=weight, eps=norm.eps if norm is not None else 1e-6)
    return linear.forward_folded(norm(h))


def _row_gemv(gemv, x: torch.Tensor, linear: Linear, residual: Optional[torch.Tensor], lora=None) -> torch.Tensor:
    """residual + x @ W^T in one GEMV (x @ W^T without residual). A row-parallel layer holds a
    slice of W's columns: rank 0 adds the residual to its partial sum, the others add nothing,
    and one all-reduce sums them; an adapter's delta (lora: LoRAEpilogue) is partial there
    too (the hook's A holds the rank's columns), summed by the same all-reduce."""
    kw = {} if lora is None else {"lora": lora}
    if isinstance(linear, tp_layers.RowParallelLinear):
        partial = None if residual is None else linear.partial_with_residual(residual)
        out = linear.tp.all_reduce(gemv(x, linear.weight, residual=partial, **kw))
        return out if linear.bias is None else out + linear.bias  # gpt-oss's o_proj: once, after the sum
    return gemv(x, linear.weight, bias=linear.bias, residual=residual, **kw)


class MissingLayer(torch.nn.Module):
    """A layer another pipeline stage holds: keeps the layer indices (and so the checkpoint
    names) of the held ones, holds nothing, and is never run."""


class DecoderModel(torch.nn.Module):
    """Embedding (scaled where the spec says), the layers, the final norm. stage: a pipeline
    stage's part (distributed/pipeline.py), its layer range and ends; None: all of it."""

    def __init__(self, cfg: ModelConfig, spec: ModelSpec, max_positions: int, backend: Optional[AttentionBackend],
                 kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE, stage: Optional[StageLayout] = None,
                 expert_parallel: bool = False):
        super().__init__()
        self.stage = stage
        self.start, self.end = (0, cfg.num_hidden_layers) if stage is None else (stage.start, stage.end)
        # Where the given backend cannot compute a part, the reference takes the model's attention;
        # it reads the step's host-side lists, which a CUDA graph would replay as captured, so the
        # model runner captures no graphs when this is set (eager steps).
        self.graph_unsafe_reason = spec.attention_fallback(backend)
        backend = attention_backend(spec, backend)
        self.embed_tokens = (tp_layers.vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
                             if stage is None or stage.has_embedding else None)
        # A 0-dim tensor in the model's dtype: HF multiplies by the scale rounded to it (Gemma).
        self.register_buffer("embed_scale", None if spec.embed_scale is None else torch.tensor(spec.embed_scale),
                             persistent=False)
        # Each layer's rotary (ModelSpec.layer_ropes): one table per distinct base/scaling/width.
        rotaries = shared_rotaries(spec.ropes(cfg), cfg.head_dim, max_positions)
        windows = spec.layer_windows or (cfg.sliding_window,) * cfg.num_hidden_layers
        mlps = spec.layer_mlps or (DENSE,) * cfg.num_hidden_layers
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, spec, window, rotary, backend, kernels, tp, mlp, expert_parallel)
            if self.start <= i < self.end else MissingLayer()
            for i, (window, rotary, mlp) in enumerate(zip(windows, rotaries, mlps)))
        self.held_layers = list(self.layers)[self.start:self.end]  # a plain list: not registered twice
        self.norm = (make_norm(spec, cfg.hidden_size, cfg.rms_norm_eps, kernels.rmsnorm)
                     if stage is None or stage.has_final_norm else None)
        log.info("decoder path: %s", decoder_path(spec, kernels))
        # rooflm/quant/native_decode.py: CPU steps (batched decodes included) as one C call over all layers,
        # where the weights allow it; decided at the first forward (the weights are loaded then).
        self.native_decoder = None
        self._native_decoder_checked = False

    def choose_decoder_path(self) -> None:
        """Decide (again) whether CPU steps run natively, from the weights as
        loaded now and ROOFLM_NATIVE_DECODE; the first forward does it when nobody did."""
        # The C decoder computes the base layers only: with LoRA hooks every step runs here; it
        # runs every layer, from the embedding to the final norm: not a pipeline stage's part.
        lora = self.stage is None and any(layer.lora_mapping is not None for layer in self.layers)
        self.native_decoder = None if lora or self.stage is not None else NativeDecoder.build(self)
        self._native_decoder_checked = True

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """The final hidden states [T, hidden]; on a pipeline stage before the last, the
        (hidden states, residual stream) its layers leave. intermediate: that pair from the
        stage before, in place of the embedding (stages after the first)."""
        if not self._native_decoder_checked:
            self.choose_decoder_path()
        if self.native_decoder is not None:
            hidden = self.native_decoder.forward(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        if intermediate is None:
            x = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                x = x * self.embed_scale
            residual = None
        else:
            x, residual = intermediate
        if self.stage is None:
            held = zip(self.layers, kv_caches)
        else:
            held = zip(self.held_layers, kv_caches[self.start:self.end])
        for layer, kv_cache in held:
            x, residual = layer(positions, x, residual, kv_cache, meta)
        if self.norm is None:  # the next stage's first pre-norm adds the two (zeros: x is whole)
            return x, torch.zeros_like(x) if residual is None else residual
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


def decoder_path(spec: ModelSpec, kernels: Kernels) -> str:
    """The INFO log's line: which fused forms the layers take, and what runs apart."""
    apart = []
    if spec.post_attn_norm or spec.post_mlp_norm or spec.residual_scale is not None:
        apart.append("post-norms / residual scales run between the linears and the residual adds")
    if spec.mlp_act != SILU:
        apart.append(f"{spec.mlp_act} in the GEMV's epilogue, apart from a quantized gate_up")
    if spec.pre_attn_norm is None or spec.pre_mlp_norm is None:
        apart.append("no FP8 codes from the norms (a sublayer without a pre-norm)")
    if MOE in spec.layer_mlps:
        apart.append("MoE blocks run as themselves beside the fused attention half "
                     f"({'fused_moe' if kernels.fused_moe is not None else 'torch experts loop'})")
    if spec.native_reason() is not None:
        apart.append(f"no native C decoder ({spec.native_reason()})")
    fused = "one-token GEMV chain" if kernels.gemv is not None else "torch/Triton per op"
    return f"{fused}; " + ("; ".join(apart) if apart else "every fused form applies")


def attention_backend(spec: ModelSpec, backend: Optional[AttentionBackend]) -> Optional[AttentionBackend]:
    """The backend the model's attention runs on: the given one, or the reference where a part
    needs what the given one cannot compute (it is then never asked to, rather than asked and wrong)."""
    if backend is None:
        return None
    reason = spec.attention_fallback(backend)
    if reason is None:
        return backend
    log.info("attention path: torch reference, not the %s backend (%s)", backend.name, reason)
    return ReferenceBackend()


class CausalLM(torch.nn.Module):
    """The decoder with its LM head (tied or not; soft-capped logits where the spec says).
    A family subclasses it and names its config -> spec mapping (model/llama.py, model/gemma2.py)."""

    @staticmethod
    def spec_of(cfg: ModelConfig) -> ModelSpec:  # pragma: no cover
        raise NotImplementedError("a family's CausalLM names its spec_of")

    def __init__(self, cfg: ModelConfig, max_positions: Optional[int] = None,
                 backend: Optional[AttentionBackend] = None, kernels: Kernels = TORCH_KERNELS,
                 tp: TPGroup = SINGLE, stage: Optional[StageLayout] = None, expert_parallel: bool = False):
        super().__init__()
        self.cfg = cfg
        self.spec = self.spec_of(cfg)
        self.stage = stage  # a pipeline stage's part (DecoderModel), None: the whole model
        self.heads = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)  # this rank's
        self.model = DecoderModel(cfg, self.spec, max_positions or cfg.max_position_embeddings, backend, kernels, tp,
                                  stage, expert_parallel)
        # Why this model must run eagerly (no CUDA graphs), or None.
        self.graph_unsafe_reason: Optional[str] = self.model.graph_unsafe_reason
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = (tp_layers.lm_head(cfg.hidden_size, cfg.vocab_size, tp, tied)
                        if stage is None or stage.has_head else None)
        self.final_softcap = self.spec.final_softcap
        self.logit_divisor = self.spec.logit_divisor  # Granite's logits_scaling
        self.gemv = kernels.gemv  # as DecoderLayer.gemv: the LM head of one token
        self.linear = kernels.linear  # the LM head's matmul (layers/kernels.py), after the GEMV's one token
        # Tied embeddings read from quantized blocks: the embedding is dequantized (a lookup reads
        # one row per token) and the LM head, which reads all of it every step, stays quantized.
        self.tied_head_quant = None
        # A checkpoint's static FP8 K/V scales, [layers, 2 (K, V)] fp32 on the host, or None
        # (quant/checkpoint.py's kv_cache_scheme); the model runner puts them in the FP8 cache.
        self.checkpoint_kv_scales: Optional[torch.Tensor] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata, intermediate=None) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; logits are computed only where needed.
        A pipeline stage: DecoderModel.forward's intermediate in and out."""
        if intermediate is None:
            return self.model(input_ids, positions, kv_caches, meta)
        return self.model(input_ids, positions, kv_caches, meta, intermediate=intermediate)

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[rows, hidden] -> fp32 logits [rows, vocab]. out: an fp32 buffer to widen them into
        (a CUDA graph's output, shared by every captured batch size) instead of a new tensor."""
        logits = self._head(hidden)
        if self.logit_divisor is not None:
            logits = logits.float() / self.logit_divisor
        if self.final_softcap is not None:
            cap = self.final_softcap
            logits = torch.tanh(logits.float() / cap) * cap
        if out is None:
            return logits.float()
        out.copy_(logits)
        return out

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head in the weights' dtype (the GEMV of one token: already fp32)."""
        if isinstance(self.lm_head, tp_layers.ParallelLMHead):
            return self.lm_head.logits(hidden)  # this rank's vocabulary rows, then one all-gather
        head = self.lm_head
        weight = self.model.embed_tokens.weight if head is None else head.weight
        quant = self.tied_head_quant if head is None else head.quant
        if self.gemv is not None and hidden.shape[0] == 1 and quant is None:
            return self.gemv(hidden, weight, out_dtype=torch.float32)
        if self.linear is not None:
            return self.linear(hidden, weight, None, quant)
        if quant is not None:
            return quant(hidden)
        return torch.nn.functional.linear(hidden, weight)

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint-named tensors into the (fused) parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints still store the head; the embedding is used
            if self.stage is not None and not self.holds_weight(name):
                continue  # another pipeline stage's
            if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                self._load_kv_scale(name, tensor)
                continue
            moe = self._moe_target(name)
            if moe is not None:  # an expert's, the router's: the block takes the checkpoint's names
                block, rest = moe
                loaded.update(f"{block}.{piece}" for piece in self.get_submodule(block).load_weight(rest, tensor))
                continue
            if is_quantized_tensor(tensor) and not _fused_targets(name):
                tensor = self._load_blocks(name, tensor)
                if tensor is None:
                    loaded.add(name)
                    continue
            for target, shard, kind in _fused_targets(name):
                module = self.get_submodule(target)
                module.load_shard(shard, kind, tensor)
                loaded.add(f"{target}.{shard}.{kind}")
                break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
                param = params[name]
                # Under tensor parallelism, this rank's part (a lazy slice reads only it).
                tensor = tp_layers.checkpoint_shard(self.get_submodule(name.rpartition(".")[0]),
                                                    name.rpartition(".")[2], tensor)
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                     f"model expects {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
        self.finish_loading()
        self.disable_gemv_where_quantized()
        missing = [n for n in self._expected_weight_names() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def holds_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this pipeline stage's part of the model."""
        stage = self.stage
        if stage is None:
            return True
        if name.startswith("model.layers."):
            return stage.holds_layer(int(name.split(".")[2]))
        if name.startswith("model.embed_tokens."):
            return stage.has_embedding
        if name.startswith("model.norm."):
            return stage.has_final_norm
        if name.startswith("lm_head."):
            return stage.has_head
        return True

    def finish_loading(self) -> None:
        """Values derived from the loaded weights, once: fused linears' layouts, (1 + w) norms'
        fused weights (written in place, so captured CUDA graphs keep reading them)."""
        for module in self.modules():
            if isinstance(module, (FusedLinear, OnePlusRMSNorm)):
                module.finish_loading()

    def _moe_target(self, name: str) -> Optional[tuple[str, str]]:
        """'model.layers.3.<moe_prefix>.experts.7.up_proj.weight' -> ('model.layers.3.mlp',
        'experts.7.up_proj.weight') where layer 3's MLP is an MoE block; else None."""
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        prefix = self.spec.moe_prefix + "."
        if not parts[3].startswith(prefix) or int(parts[2]) >= len(self.model.layers):
            return None
        if self.model.layers[int(parts[2])].dense_mlp:
            return None
        return f"model.layers.{parts[2]}.mlp", parts[3][len(prefix):]

    def _load_kv_scale(self, name: str, tensor) -> None:
        """'model.layers.3.self_attn.k_scale' (one fp32, per tensor) -> checkpoint_kv_scales[3, 0]."""
        tensor = tensor.load() if hasattr(tensor, "load") else tensor  # a lazy slice (TP loading)
        value = float(tensor.reshape(-1)[0])
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"checkpoint tensor {name!r} is {value}: a K/V scale must be positive and finite")
        if self.checkpoint_kv_scales is None:
            self.checkpoint_kv_scales = torch.ones(self.cfg.num_hidden_layers, 2, dtype=torch.float32, device="cpu")
        layer = int(name.split(".")[2])
        self.checkpoint_kv_scales[layer, 0 if name.endswith("k_scale") else 1] = value

    def disable_gemv_where_quantized(self) -> None:
        """The fused batch-1 GEMV path reads float weights: layers whose linears are quantized take
        the plain path, whose Linear calls the quantized kernel."""
        for layer in self.model.layers:
            if any(m.quant is not None for m in layer.modules() if isinstance(m, Linear)):
                layer.gemv = None
        if self.lm_head is not None and self.lm_head.quant is not None:
            self.gemv = None

    def _load_blocks(self, name: str, blocks) -> Optional[torch.Tensor]:
        """A quantized checkpoint tensor that is not a fused shard: a Linear takes it as it is;
        the embedding is dequantized (and, when tied, also kept quantized as the LM head).
        Returns the float tensor for the caller to copy where there is no quantized use."""
        module_name = name.rpartition(".")[0]
        module = self.get_submodule(module_name)
        if isinstance(module, Linear) and name.endswith(".weight"):
            module.load_blocks(blocks)
            return None
        if name == "model.embed_tokens.weight" and self.cfg.tie_word_embeddings:
            weight = self.model.embed_tokens.weight
            self.tied_head_quant = make_linear_method(blocks, weight.device, weight.dtype)
        return blocks.dequantize()

    def _expected_weight_names(self) -> Iterator[str]:
        for name, module in self.named_modules():
            if isinstance(module, FusedLinear):
                for shard in module.shard_offsets:
                    yield f"{name}.{shard}.weight"
                    if module.bias is not None:
                        yield f"{name}.{shard}.bias"
            elif isinstance(module, SparseMoeBlock):  # its stacked parameters fill piece by piece
                yield from (f"{name}.{piece}" for piece in module.weight_pieces())
        fused_prefixes = tuple(n + "." for n, m in self.named_modules() if isinstance(m, (FusedLinear, SparseMoeBlock)))
        for name, _ in self.named_parameters():
            if not name.startswith(fused_prefixes):
                yield name

    def dummy_weights(self, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights init_dummy_weights draws for the whole (single-device) model, as
        checkpoint-named tensors, fused ones split again: a tensor-parallel rank loads its part of
        the same weights through load_weights. Each whole tensor exists once, briefly, on this device."""
        sample = next(self.parameters())
        with torch.device("meta"):
            whole = type(self)(self.cfg, max_positions=1)
        gen = torch.Generator(device=sample.device).manual_seed(seed)
        fused = {name: m for name, m in whole.named_modules() if isinstance(m, FusedLinear)}
        # An MoE block's stacked parameters leave as the per-expert checkpoint tensors, once the
        # block's last one is drawn (the draws keep init_dummy_weights' order).
        moe = {name + ".": m for name, m in whole.named_modules() if isinstance(m, SparseMoeBlock)}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in whole.named_parameters():
            tensor = torch.empty(param.shape, dtype=sample.dtype, device=sample.device)
            _dummy_fill(name, tensor, gen)
            block = next((b for b in moe if name.startswith(b)), None)
            if block is not None:
                params = pending.setdefault(block, {})
                params[name[len(block):]] = tensor
                if len(params) == len(list(moe[block].parameters())):
                    stem = block[:-len("mlp.")] + self.spec.moe_prefix
                    for rest, t in hub_tensors(moe[block].cfg, pending.pop(block), self.spec.expert_projs):
                        yield f"{stem}.{rest}", t
                continue
            module_name, _, kind = name.rpartition(".")
            if module_name not in fused:
                yield name, tensor
                continue
            for src, (dst, shard) in _FUSED.items():  # back to the checkpoint's q/k/v, gate/up
                if module_name.endswith("." + dst):
                    offset, size = fused[module_name].shard_offsets[shard]
                    yield f"{module_name[:-len(dst)]}{src}.{kind}", tensor[offset:offset + size]

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes, generated where the parameters live."""
        gen = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                _dummy_fill(name, param, gen)
        self.finish_loading()


def _dummy_fill(name: str, tensor: torch.Tensor, gen: torch.Generator) -> None:
    with torch.no_grad():
        if name.endswith("norm.weight") or "layernorm" in name:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=gen)


_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}


def _fused_targets(name: str):
    """'model.layers.3.self_attn.k_proj.weight' -> [('model.layers.3.self_attn.qkv_proj', 'k', 'weight')]."""
    prefix, _, kind = name.rpartition(".")
    for src, (dst, shard) in _FUSED.items():
        if prefix.endswith("." + src):
            return [(prefix[: -len(src)] + dst, shard, kind)]
    return []
