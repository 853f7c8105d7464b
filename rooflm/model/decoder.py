"""The parts decoder: a dense decoder built from a ModelSpec (model/spec.py) with its options on.

What a family adds to the Llama decoder is a choice of parts, not a new forward: norms before
and/or after each sublayer, (1 + w) norms, q/k norms per head or over the projection, a scale
and soft-cap on the attention scores, a window per layer, a scaled embedding, a GELU-tanh
gated MLP and soft-capped logits. Each is decided here at init.

The fused paths of LlamaDecoderLayer (the one-token GEMV chain, folded W4, fused FP8 norm+quant,
the native C decoder) assume the Llama layer (pre-norm RMSNorm, SiLU); this decoder runs the
torch path with the fused norm, SiLU-mul and linear kernels where a part is the plain one, and
the attention kernels unless a part needs what they cannot compute (then the reference backend).
The INFO log names the path taken and why.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from rooflm.config import ModelConfig
from rooflm.distributed import layers as tp_layers
from rooflm.distributed.group import SINGLE, TPGroup
from rooflm.layers.activation import GeluTanhAndMul
from rooflm.layers.attention import Attention, AttentionBackend, ReferenceBackend, SoftcappedAttention
from rooflm.layers.kernels import TORCH_KERNELS, Kernels
from rooflm.layers.norm import OnePlusRMSNorm, RMSNorm
from rooflm.layers.rotary import RotaryEmbedding, shared_rotaries
from rooflm.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from rooflm.model.spec import GELU_TANH, QK_NORM_HEAD, QK_NORM_PROJ, RMS, ModelSpec

log = logging.getLogger(__name__)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _Scaled:
    """f(x) * scale: a post-sublayer transform with the residual multiplier after it."""

    def __init__(self, f, scale: float):
        self.f, self.scale = f, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) * self.scale


def make_norm(spec: ModelSpec, size: int, eps: float, kernel=None) -> torch.nn.Module:
    """The family's norm over `size` features; the fused kernel only serves w * norm(x)."""
    if spec.norm == RMS:
        return RMSNorm(size, eps, kernel)
    return OnePlusRMSNorm(size, eps)


class PartsAttention(LlamaAttention):
    """LlamaAttention's projections with the spec's q/k norm, score scale, soft-cap and window."""

    def __init__(self, cfg: ModelConfig, spec: ModelSpec, window: Optional[int], rotary: RotaryEmbedding,
                 backend: Optional[AttentionBackend], kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        torch.nn.Module.__init__(self)  # LlamaAttention's own init reads cfg.qk_norm, not the spec
        self.cfg = cfg
        self.heads = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
        self.qkv_proj = tp_layers.qkv_linear(cfg.hidden_size, self.heads, cfg.head_dim, cfg.attention_bias, tp,
                                             kernels.linear)
        self.o_proj = tp_layers.row_linear(cfg.q_size, cfg.hidden_size, tp, kernels.linear)
        self.qk_norm = spec.qk_norm
        eps = cfg.rms_norm_eps
        if spec.qk_norm == QK_NORM_HEAD:
            self.q_norm = make_norm(spec, cfg.head_dim, eps, kernels.head_norm)
            self.k_norm = make_norm(spec, cfg.head_dim, eps, kernels.head_norm)
        elif spec.qk_norm == QK_NORM_PROJ:
            if tp.size > 1:  # the mean of squares would need every rank's heads: one more all-reduce
                raise ValueError("q/k norms over the whole projection (OLMo 2) do not run with "
                                 "tensor_parallel_size > 1 yet")
            self.q_norm = make_norm(spec, cfg.q_size, eps, kernels.rmsnorm)
            self.k_norm = make_norm(spec, cfg.kv_size, eps, kernels.rmsnorm)
        heads = (self.heads.num_heads, self.heads.num_kv_heads, cfg.head_dim, rotary)
        if spec.attn_softcap is not None:
            self.attn = SoftcappedAttention(*heads, spec.attn_softcap, window, backend, spec.attn_scale)
        else:
            self.attn = Attention(*heads, window, backend, spec.attn_scale)

    def attend(self, positions, qkv, kv_cache, meta):
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
        return self.attn(positions, q, k, v, kv_cache, meta)


class GeluTanhMLP(LlamaMLP):
    """The gated MLP with gelu_tanh(gate) * up (Gemma); a quantized gate_up's fused SiLU-mul
    does not apply."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__(cfg, kernels, tp)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class PartsDecoderLayer(torch.nn.Module):
    """h + post_attn(attn(pre_attn(h))), then the same around the MLP; an absent norm is the
    identity. The norms are registered under their checkpoint names (ModelSpec's), so the
    weights load by name. The residual stream is returned whole (residual None)."""

    native_form = False  # quant/native_decode.py refuses the layer: the C decoder computes Llama's

    def __init__(self, cfg: ModelConfig, spec: ModelSpec, window: Optional[int], rotary: RotaryEmbedding,
                 backend: Optional[AttentionBackend], kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = PartsAttention(cfg, spec, window, rotary, backend, kernels, tp)
        self.mlp = GeluTanhMLP(cfg, kernels, tp) if spec.mlp_act == GELU_TANH else LlamaMLP(cfg, kernels, tp)
        norms = []
        for name in (spec.pre_attn_norm, spec.post_attn_norm, spec.pre_mlp_norm, spec.post_mlp_norm):
            if name is None:
                norms.append(_identity)
                continue
            norm = make_norm(spec, cfg.hidden_size, cfg.rms_norm_eps, kernels.rmsnorm)
            self.add_module(name, norm)
            norms.append(norm)
        if spec.residual_scale is not None:  # Granite: each sublayer's output scaled before its add
            norms[1], norms[3] = _Scaled(norms[1], spec.residual_scale), _Scaled(norms[3], spec.residual_scale)
        # A tuple, which nn.Module does not register: the modules are registered once, by name.
        self.norms = tuple(norms)

    def forward(self, positions, x, residual, kv_cache, meta):
        pre_attn, post_attn, pre_mlp, post_mlp = self.norms
        h = x if residual is None else x + residual
        h = h + post_attn(self.self_attn(positions, pre_attn(h), kv_cache, meta))
        return h + post_mlp(self.mlp(pre_mlp(h))), None


class PartsModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec, max_positions: int, backend: Optional[AttentionBackend],
                 kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        torch.nn.Module.__init__(self)
        given = backend
        backend = attention_backend(spec, backend)
        # The reference backend reads the step's host-side lists: a CUDA graph would replay the
        # captured ones. The model runner captures no graphs when this is set (eager steps).
        self.graph_unsafe_reason = None if backend is given else spec.attention_fallback()
        self.embed_tokens = tp_layers.vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        # A 0-dim tensor in the model's dtype: HF multiplies by the scale rounded to it (Gemma).
        self.register_buffer("embed_scale", None if spec.embed_scale is None else torch.tensor(spec.embed_scale),
                             persistent=False)
        # Each layer's rotary (ModelSpec.layer_ropes): one table per distinct base/scaling/width.
        rotaries = shared_rotaries(spec.ropes(cfg), cfg.head_dim, max_positions)
        windows = spec.layer_windows or (cfg.sliding_window,) * cfg.num_hidden_layers
        self.layers = torch.nn.ModuleList(
            PartsDecoderLayer(cfg, spec, window, rotary, backend, kernels, tp)
            for window, rotary in zip(windows, rotaries))
        self.norm = make_norm(spec, cfg.hidden_size, cfg.rms_norm_eps, kernels.rmsnorm)
        log.info("decoder path: parts decoder (torch, fused norm/activation/linear kernels where the part is "
                 "plain); no one-token GEMV chain, folded W4, fused FP8 norm+quant or native C decoder: "
                 "they compute the Llama layer only")
        self.native_decoder = None
        self._native_decoder_checked = True

    def choose_decoder_path(self) -> None:
        """The native C decoder computes the Llama layer only: never chosen here."""

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x)


def attention_backend(spec: ModelSpec, backend: Optional[AttentionBackend]) -> Optional[AttentionBackend]:
    """The backend the model's attention runs on: the given one, or the reference where a part
    needs what the given one cannot compute (it is then never asked to, rather than asked and wrong)."""
    reason = spec.attention_fallback()
    if backend is None or reason is None:
        return backend
    if isinstance(backend, ReferenceBackend) and (backend.supports_softcap or spec.attn_softcap is None):
        return backend  # the torch backends attend per layer, with its own window
    log.info("attention path: torch reference, not the %s backend (%s)", backend.name, reason)
    return ReferenceBackend()


class PartsForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM over the parts decoder, with soft-capped logits where the spec says.
    A family subclasses it and names its config -> spec mapping (model/olmo2.py, model/gemma2.py)."""

    @staticmethod
    def spec_of(cfg: ModelConfig) -> ModelSpec:  # pragma: no cover
        raise NotImplementedError("a family's PartsForCausalLM names its spec_of")

    def __init__(self, cfg: ModelConfig, max_positions: Optional[int] = None,
                 backend: Optional[AttentionBackend] = None, kernels: Kernels = TORCH_KERNELS,
                 tp: TPGroup = SINGLE):
        self.spec = self.spec_of(cfg)
        super().__init__(cfg, max_positions, backend, kernels, tp)
        self.final_softcap = self.spec.final_softcap
        self.logit_divisor = self.spec.logit_divisor

    def make_model(self, cfg, max_positions, backend, kernels, tp) -> LlamaModel:
        return PartsModel(cfg, self.spec, max_positions, backend, kernels, tp)

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.final_softcap is None and self.logit_divisor is None:
            return super().compute_logits(hidden, out)
        logits = self._head(hidden).float()
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if out is None:
            return logits
        out.copy_(logits)
        return out
