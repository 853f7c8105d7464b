"""The training view of a rooflm model: [B, S] token ids -> next-token loss, causal SDPA.

The inference model attends through a paged KV cache with packed, variable-length
batches. Training has neither: every sequence is S tokens from position 0, and the
backward pass needs attention that autograd understands. CausalLM wraps the *same*
modules (same Parameters, same loaders, same RMSNorm / SiLU-mul / rotary code) and
runs them in the plain causal form, so the inference path keeps no training branch.

Each decoder layer is wrapped in a CausalBlock, the unit that FSDP shards, that
activation checkpointing recomputes and that torch.compile compiles: its forward is
the whole layer, called through nn.Module.__call__ so the hooks of each fire.

Precision follows HF training: parameters stay fp32 (the master copy) and
torch.autocast runs the matmuls in bf16 / fp16, so the residual stream and the norms
stay fp32 exactly as in HF transformers under autocast.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rooflm.config import ModelConfig
from rooflm.layers.rotary import apply_rope_torch
from rooflm.train.qat import plain_name


def _saved_ops() -> set:
    """Ops whose outputs selective checkpointing keeps: the matmuls and attention, the expensive
    ones; everything element-wise between them is recomputed (torchtitan's op-level policy)."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return ops


def _selective_policy(saved, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(partial(_selective_policy, _saved_ops()))


class CausalBlock(torch.nn.Module):
    """One Llama-layer DecoderLayer (model/decoder.py) run on [B, S, hidden] with causal attention over its own S tokens."""

    def __init__(self, layer: torch.nn.Module, cfg: ModelConfig, recompute: str = "none"):
        super().__init__()
        self.layer = layer
        self.cfg = cfg
        self.recompute = recompute  # none | full | selective

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        if self.recompute == "none" or not torch.is_grad_enabled():
            return self._layer(x, cos, sin, mask)
        extra = {"context_fn": _selective_context} if self.recompute == "selective" else {}
        return checkpoint(self._layer, x, cos, sin, mask, use_reentrant=False, **extra)

    def _layer(self, x, cos, sin, mask):
        layer = self.layer
        h = x + self._attention(layer.input_layernorm(x), cos, sin, mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _attention(self, x, cos, sin, mask):
        cfg, attn = self.cfg, self.layer.self_attn
        b, s, _ = x.shape
        q, k, v = attn.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(b, s, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(b, s, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(b, s, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        # The rotary table is fp32; HF casts it to q's dtype before rotating, as does inference.
        q = apply_rope_torch(q, cos.to(q.dtype), sin.to(q.dtype))
        k = apply_rope_torch(k, cos.to(k.dtype), sin.to(k.dtype))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        if group > 1:
            # Expanded K/V rather than enable_gqa: every SDPA backend (cuDNN included) takes it.
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=attn.attn.scale)
        return attn.o_proj(o.transpose(1, 2).reshape(b, s, cfg.q_size))


class CausalLM(torch.nn.Module):
    """A LlamaForCausalLM's modules, run as a causal LM: forward(input_ids, targets) -> mean loss."""

    def __init__(self, model: torch.nn.Module, recompute: str = "none"):
        super().__init__()
        cfg: ModelConfig = model.cfg
        self.cfg = cfg
        self.embed_tokens = model.model.embed_tokens
        self.blocks = torch.nn.ModuleList(CausalBlock(layer, cfg, recompute) for layer in model.model.layers)
        self.norm = model.model.norm
        self.lm_head = model.lm_head  # None when tied to the embedding
        # One rotary table, shared by every layer (a non-persistent buffer: nothing to save).
        self.rotary = model.model.layers[0].self_attn.attn.rotary
        # The trainer may swap in a compiled copy, which fuses the fp32 up-cast into the
        # log-softmax instead of writing fp32 logits (4 bytes x vocab per token) to memory.
        self.loss_fn = next_token_loss

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, targets: Optional[torch.Tensor] = None,
                return_logits: bool = False):
        """input_ids [B, S] -> the mean next-token loss against targets [B, S]; with
        return_logits (or no targets) the logits [B, S, vocab] too (distillation needs them)."""
        s = input_ids.shape[1]
        if s > self.rotary.cos_sin_cache.shape[0]:
            raise ValueError(f"sequence of {s} tokens is longer than the rotary table "
                             f"({self.rotary.cos_sin_cache.shape[0]} positions)")
        cos, sin = self.rotary.cos_sin_cache[:s].chunk(2, dim=-1)
        mask = self._window_mask(s, input_ids.device)
        x = self.embed_tokens(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        logits = F.linear(self.norm(x), self.head_weight())
        if targets is None:
            return logits
        loss = self.loss_fn(logits, targets)
        return (loss, logits) if return_logits else loss


    def _window_mask(self, s: int, device) -> Optional[torch.Tensor]:
        """None (plain causal) unless a sliding window is shorter than the sequence."""
        window = self.cfg.sliding_window
        if window is None or s <= window:
            return None
        pos = torch.arange(s, device=device)
        distance = pos[:, None] - pos[None, :]
        return (distance >= 0) & (distance < window)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---- names: rooflm's fused parameters <-> HF's checkpoint tensors ------------------------

def hf_name(name: str) -> str:
    """A CausalLM parameter name in HF's layout ('blocks.3.layer.mlp...' -> 'model.layers.3.mlp...')."""
    if name.startswith("blocks."):
        index, _, rest = name[len("blocks."):].partition(".layer.")
        return f"model.layers.{index}.{rest}"
    if name.startswith(("embed_tokens.", "norm.")):
        return "model." + name
    return name


def hf_state_dict(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Split the fused q/k/v and gate/up tensors back into HF's names and shapes, so a
    checkpoint loads in rooflm (serve, generate, resume) and in transformers alike."""
    # FusedLinear, or a layer swapped in for it that kept its shard map (fp8 training).
    fused = {name: module for name, module in model.named_modules() if hasattr(module, "shard_offsets")}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        name = plain_name(name)  # QAT: the fp32 master weight under its own name
        prefix, _, kind = name.rpartition(".")
        module = fused.get(prefix)
        if module is None:
            out[hf_name(name)] = tensor.contiguous()
            continue
        hf_prefix = hf_name(prefix).rpartition(".")[0]  # '...self_attn.qkv_proj' -> '...self_attn'
        for shard, (offset, size) in module.shard_offsets.items():
            shard_module = {"q": "q_proj", "k": "k_proj", "v": "v_proj",
                            "gate": "gate_proj", "up": "up_proj"}[shard]
            out[f"{hf_prefix}.{shard_module}.{kind}"] = tensor[offset:offset + size].contiguous()
    return out
