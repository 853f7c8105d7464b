"""What a family's decoder is made of: the part options, derived once from its ModelConfig.

A family file (model/olmo2.py, model/gemma2.py; model/registry.py for the Llama family) maps
its config to a ModelSpec; the decoder (model/llama.py, model/decoder.py) builds its parts
from the spec at init and never looks at the family again. The spec also names the
checkpoint tensors of each norm, so the model's parameters carry the checkpoint's names
and load by name.

Every family runs on the one decoder of model/decoder.py, whose fast paths belong to the parts
they fuse; llama_layers says whether the spec is the Llama layer itself, the one the native C
decoder and the training lab compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rooflm.config import ModelConfig
from rooflm.layers.rotary import Rope
from rooflm.layers.moe import MoeConfig

RMS = "rms"  # w * norm(x), HF Llama's casts
RMS_ONE_PLUS = "rms_one_plus"  # (1 + w) * norm(x) in fp32, then cast (Gemma)
QK_NORM_HEAD = "head"  # RMSNorm over each head of q and k (Qwen3)
QK_NORM_PROJ = "proj"  # RMSNorm over the whole q and k projections (OLMo 2)
SILU = "silu"
GELU_TANH = "gelu_tanh"
DENSE = "dense"  # a layer's MLP part: the gated MLP
MOE = "moe"  # ... or a sparse MoE block (layers/moe.py SparseMoeBlock)


@dataclass(frozen=True)
class ModelSpec:
    # The decoder layer's norms by place, each the checkpoint name of its weight, or None where
    # the family has no norm there. Pre-norms normalise a sublayer's input; post-norms its
    # output, before the residual add.
    pre_attn_norm: Optional[str] = "input_layernorm"
    post_attn_norm: Optional[str] = None
    pre_mlp_norm: Optional[str] = "post_attention_layernorm"
    post_mlp_norm: Optional[str] = None
    norm: str = RMS
    qk_norm: Optional[str] = None
    attn_scale: Optional[float] = None  # None: head_dim ** -0.5
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    # One window per layer (None: full attention); every layer the same for the Llama family.
    layer_windows: tuple[Optional[int], ...] = ()
    embed_scale: Optional[float] = None  # x * embed_scale after the lookup (Gemma: sqrt(hidden))
    mlp_act: str = SILU
    # One rotary per layer: its base, scaling and rotated width, or None for a layer without RoPE
    # (SmolLM3); equal Ropes share one table. Empty: every layer the config's rope, whole head.
    layer_ropes: tuple[Optional[Rope], ...] = ()
    # Each sublayer's output times this before its residual add (Granite's residual_multiplier).
    residual_scale: Optional[float] = None
    # The logits divided by this (Granite's logits_scaling), before any final soft-cap.
    logit_divisor: Optional[float] = None
    # Each layer's MLP part, DENSE or MOE (empty: every layer dense), the experts' config
    # (derived once from ModelConfig: moe_parts), and the checkpoint's names of the block
    # ("model.layers.{i}.<moe_prefix>.") and of each expert's gate, up and down projections.
    layer_mlps: tuple[str, ...] = ()
    moe: Optional[MoeConfig] = None
    moe_prefix: str = "mlp"
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # gpt-oss: one learned logit per query head in each softmax's denominator (self_attn.sinks),
    # and a bias on o_proj (self_attn.o_proj.bias) beside the q/k/v ones of cfg.attention_bias.
    attn_sinks: bool = False
    o_proj_bias: bool = False

    def __post_init__(self) -> None:
        if self.norm not in (RMS, RMS_ONE_PLUS):
            raise ValueError(f"ModelSpec.norm must be {RMS} or {RMS_ONE_PLUS}, got {self.norm!r}")
        if self.qk_norm not in (None, QK_NORM_HEAD, QK_NORM_PROJ):
            raise ValueError(f"ModelSpec.qk_norm must be None, {QK_NORM_HEAD} or {QK_NORM_PROJ}, got {self.qk_norm!r}")
        if self.mlp_act not in (SILU, GELU_TANH):
            raise ValueError(f"ModelSpec.mlp_act must be {SILU} or {GELU_TANH}, got {self.mlp_act!r}")
        if set(self.layer_mlps) - {DENSE, MOE}:
            raise ValueError(f"ModelSpec.layer_mlps entries must be {DENSE} or {MOE}, got {self.layer_mlps}")
        if MOE in self.layer_mlps and self.moe is None:
            raise ValueError("ModelSpec.layer_mlps has MoE layers but no moe config")

    @property
    def llama_layers(self) -> bool:
        """Whether this is the Llama layer (every part option off): what the native C decoder
        (quant/native_decode.py) and the training lab (train/causal.py) compute."""
        return (self.pre_attn_norm == "input_layernorm" and self.pre_mlp_norm == "post_attention_layernorm"
                and self.post_attn_norm is None and self.post_mlp_norm is None and self.norm == RMS
                and self.qk_norm in (None, QK_NORM_HEAD) and self.attn_scale is None
                and self.attn_softcap is None and self.final_softcap is None
                and len(set(self.layer_windows)) <= 1 and self.embed_scale is None and self.mlp_act == SILU
                and not self.layer_ropes and self.residual_scale is None and self.logit_divisor is None
                and MOE not in self.layer_mlps and not self.attn_sinks and not self.o_proj_bias)

    def native_reason(self) -> Optional[str]:
        """Why the native C decoder (quant/csrc/decode_layer.c) cannot compute this model's layers,
        or None: it takes pre-norms (either form), post-norms, per-head q/k norms, GELU-tanh, a
        residual scale, per-layer rotaries (bases, partial, none) and windows."""
        if self.pre_attn_norm is None or self.pre_mlp_norm is None:
            return "a sublayer without a pre-norm"
        if self.qk_norm == QK_NORM_PROJ:
            return "q/k norms over the whole projection"
        if self.attn_softcap is not None:
            return "attention soft-capping"
        if self.attn_sinks:
            return "attention sinks"
        if self.o_proj_bias:
            return "an o_proj bias"
        if MOE in self.layer_mlps:
            return "mixture-of-experts blocks"
        return None

    def ropes(self, cfg: ModelConfig) -> tuple[Optional[Rope], ...]:
        """Each layer's rotary (layer_ropes, or the config's rope on every layer)."""
        if not self.layer_ropes:
            return (Rope(cfg.rope_theta, cfg.rope_scaling),) * cfg.num_hidden_layers
        if len(self.layer_ropes) != cfg.num_hidden_layers:
            raise ValueError(f"layer_ropes has {len(self.layer_ropes)} entries for {cfg.num_hidden_layers} layers")
        return self.layer_ropes

    def norm_names(self) -> tuple[str, ...]:
        """The checkpoint names of a layer's norms, in the order the layer applies them."""
        names = (self.pre_attn_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm)
        return tuple(n for n in names if n is not None)

    def attention_fallback(self, backend) -> Optional[str]:
        """Why `backend` (an AttentionBackend, or None: the default) cannot compute this model's
        attention, or None when it can."""
        if backend is not None and self.attn_softcap is not None and not backend.supports_softcap:
            return f"attention logit soft-capping: the {backend.name} backend has none"
        if backend is not None and self.attn_sinks and not backend.supports_sinks:
            return f"attention sinks: the {backend.name} backend has none"
        return None


def layer_windows(cfg: ModelConfig) -> tuple[Optional[int], ...]:
    """Each layer's window: cfg.sliding_window on "sliding_attention" layers (every layer when
    the config has no layer_types), None on "full_attention" ones."""
    if not cfg.layer_types:
        return (cfg.sliding_window,) * cfg.num_hidden_layers
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(cfg.layer_types)} entries for {cfg.num_hidden_layers} layers")
    unknown = set(cfg.layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}; rooflm runs sliding_attention "
                         f"and full_attention layers")
    return tuple(cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types)


def rotary_dim(cfg: ModelConfig) -> Optional[int]:
    """The rotated width of a head under cfg.partial_rotary_factor (HF's int(head_dim * factor));
    None where it is the whole head."""
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    return None if dim == cfg.head_dim else dim


def llama_spec(cfg: ModelConfig) -> ModelSpec:
    """Llama 2/3/3.1, Mistral, SmolLM2, Qwen2/2.5, Qwen3: pre-norm RMSNorm, SiLU, one window."""
    return ModelSpec(qk_norm=QK_NORM_HEAD if cfg.qk_norm else None, layer_windows=layer_windows(cfg))


def moe_parts(cfg: ModelConfig) -> dict:
    """A mixture-of-experts family's ModelSpec fields from its config: which layers are sparse
    (ModelConfig.is_moe_layer, HF's rule) and the experts' MoeConfig."""
    moe = MoeConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                    shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    mlps = tuple(MOE if cfg.is_moe_layer(i) else DENSE for i in range(cfg.num_hidden_layers))
    return dict(layer_mlps=mlps, moe=moe)
