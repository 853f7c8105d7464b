"""One decoder definition for the Llama family: Llama 2/3/3.1, Mistral, SmolLM2,
Qwen2/2.5 (q/k/v bias) and Qwen3 (RMSNorm over each q and k head).

The model consumes a packed step: input_ids and positions of every scheduled
token, one KVCache (K and V pools, and FP8 scales) per layer, and the step's AttentionMetadata.
Parameter names follow HF's, so a checkpoint's tensors map onto them by name.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from rooflm.config import ModelConfig
from rooflm.distributed import layers as tp_layers
from rooflm.distributed.group import SINGLE, TPGroup
from rooflm.layers.activation import SiluAndMul
from rooflm.layers.attention import Attention, AttentionBackend, AttentionMetadata
from rooflm.layers.kernels import TORCH_KERNELS, Kernels
from rooflm.layers.kv_cache import KVCache
from rooflm.layers.linear import FusedLinear, Linear
from rooflm.layers.norm import RMSNorm
from rooflm.layers.rotary import RotaryEmbedding
from rooflm.quant.formats import is_quantized_tensor
from rooflm.quant.linear_method import make_linear_method
from rooflm.quant.native_decode import NativeDecoder


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: Optional[AttentionBackend],
                 kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg = cfg
        # This rank's heads (all of them on one device): q/k/v are column-parallel by head,
        # o_proj row-parallel, so attention itself needs no communication.
        self.heads = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
        self.qkv_proj = tp_layers.qkv_linear(cfg.hidden_size, self.heads, cfg.head_dim, cfg.attention_bias, tp,
                                             kernels.linear)
        self.o_proj = tp_layers.row_linear(cfg.q_size, cfg.hidden_size, tp, kernels.linear)
        if cfg.qk_norm:  # over each head ([T, H, D]): torch, or Kernels.head_norm
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels.head_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels.head_norm)
        self.attn = Attention(self.heads.num_heads, self.heads.num_kv_heads, cfg.head_dim, rotary,
                              cfg.sliding_window, backend)

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
        q = q.view(t, heads.num_heads, head_dim)
        k = k.view(t, heads.num_kv_heads, head_dim)
        v = v.view(t, heads.num_kv_heads, head_dim)
        if self.cfg.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return self.attn(positions, q, k, v, kv_cache, meta)


class LlamaMLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__()
        # Column-parallel gate/up, row-parallel down: one all-reduce for the MLP.
        self.gate_up_proj = tp_layers.merged_column_linear(
            cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}, tp, kernels.linear)
        self.down_proj = tp_layers.row_linear(cfg.intermediate_size, cfg.hidden_size, tp, kernels.linear)
        self.act = SiluAndMul(kernels.silu_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A quantized gate_up may apply SiLU-mul in its own kernel (W4A16 at small M: one launch
        # fewer, gate_up never written); None: the two ops.
        h = self.gate_up_proj.forward_silu_mul(x)
        return self.down_proj(h if h is not None else self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: Optional[AttentionBackend],
                 kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rmsnorm)
        self.self_attn = LlamaAttention(cfg, rotary, backend, kernels, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rmsnorm)
        self.mlp = LlamaMLP(cfg, kernels, tp)
        # On CUDA (rooflm.kernels.gemv.gemv): one-token steps run the layer as four weight
        # GEMVs with the norms, SiLU-mul and residual adds folded in.
        self.gemv = kernels.gemv
        # Quantized linears may fold the same neighbours into their own kernels (one rank only:
        # a row-parallel layer's partial sums must be reduced before the residual add).
        self.fold = tp.size == 1

    def forward(self, positions, x, residual, kv_cache, meta):
        if self.gemv is not None and x.shape[0] == 1:
            return self._forward_gemv(positions, x, residual, kv_cache, meta)
        if self.fold and x.shape[0] == 1:
            folded = self._forward_folded(positions, x, residual, kv_cache, meta)
            if folded is not None:
                return folded
        if self.fold and self._fp8_inputs():
            return self._forward_fp8(positions, x, residual, kv_cache, meta)
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_gemv(self, positions, x, residual, kv_cache, meta):
        """One token: the same math (and casts) as forward, in four fused GEMVs. The residual
        stream h is returned whole (residual None): the adds happen in the GEMV epilogues."""
        gemv, attn, mlp = self.gemv, self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        h = x if residual is None else x + residual
        qkv = gemv(h, attn.qkv_proj.weight, bias=attn.qkv_proj.bias, norm_weight=ln1.weight, eps=ln1.eps)
        h = _row_gemv(gemv, attn.attend(positions, qkv, kv_cache, meta), attn.o_proj, h)
        act = gemv(h, mlp.gate_up_proj.weight, norm_weight=ln2.weight, eps=ln2.eps, gated=True)
        return _row_gemv(gemv, act, mlp.down_proj, h), None

    def _fp8_inputs(self) -> bool:
        """Whether qkv, gate_up and down take E4M3 codes from the norm / SiLU-mul before them."""
        attn, mlp = self.self_attn, self.mlp
        return all(lin.fp8_input() is not None for lin in (attn.qkv_proj, mlp.gate_up_proj, mlp.down_proj))

    def _forward_fp8(self, positions, x, residual, kv_cache, meta):
        """forward for FP8 W8A8 linears: the norms and the SiLU-mul write E4M3 codes and scales
        (per token, or the linear's static input scale) in their own kernels, so the bf16 inputs
        of qkv, gate_up and down are never written and no quantization pass reads them. The same
        codes as forward's (kernels/norm_act_fp8.py: bit for bit). o_proj quantizes its own input."""
        from rooflm.kernels.norm_act_fp8 import rmsnorm_fp8, silu_mul_fp8  # Triton: imported where used
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv_q, down_q = attn.qkv_proj.fp8_input(), mlp.down_proj.fp8_input()
        if residual is None:
            residual = x
            qx, sx = rmsnorm_fp8(x, ln1.weight, ln1.eps, static_scale=qkv_q.input_scale)
        else:
            qx, sx, residual = rmsnorm_fp8(x, ln1.weight, ln1.eps, residual, static_scale=qkv_q.input_scale)
        qkv = attn.qkv_proj.forward_fp8(qx, sx, x.dtype)
        x = attn.o_proj(attn.attend(positions, qkv, kv_cache, meta))
        qx, sx, residual = rmsnorm_fp8(x, ln2.weight, ln2.eps, residual,
                                       static_scale=mlp.gate_up_proj.fp8_input().input_scale)
        qa, sa = silu_mul_fp8(mlp.gate_up_proj.forward_fp8(qx, sx, x.dtype), static_scale=down_q.input_scale)
        return mlp.down_proj.forward_fp8(qa, sa, x.dtype), residual

    def _forward_folded(self, positions, x, residual, kv_cache, meta):
        """One token through quantized linears that take the norms and residual adds into their
        kernels (W4A16's mma kernel: NORM, RESIDUAL, GATED): forward's math and casts, no norm
        launches; the residual stream h is returned whole (residual None), as _forward_gemv does.
        None, with nothing computed, where qkv's method cannot fold; a later linear that cannot
        runs its neighbours apart."""
        attn, mlp = self.self_attn, self.mlp
        if not getattr(attn.qkv_proj.quant, "can_fold", False):
            return None
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        h = x if residual is None else x + residual
        qkv = attn.qkv_proj.forward_folded(h, norm_weight=ln1.weight, eps=ln1.eps)
        if qkv is None:
            return None
        a = attn.attend(positions, qkv, kv_cache, meta)
        h_attn = attn.o_proj.forward_folded(a, residual=h)
        if h_attn is None:
            h_attn = attn.o_proj(a) + h
        act = mlp.gate_up_proj.forward_silu_mul(h_attn, norm_weight=ln2.weight, eps=ln2.eps)
        if act is None:
            return mlp(ln2(h_attn)) + h_attn, None
        h_mlp = mlp.down_proj.forward_folded(act, residual=h_attn)
        return (h_mlp if h_mlp is not None else mlp.down_proj(act) + h_attn), None


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: Optional[AttentionBackend],
                 kernels: Kernels = TORCH_KERNELS, tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = tp_layers.vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        # One rotary table shared by all layers.
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, backend, kernels, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rmsnorm)
        # rooflm/quant/native_decode.py: single-sequence CPU steps as one C call over all layers,
        # where the weights allow it; decided at the first forward (the weights are loaded then).
        self.native_decoder = None
        self._native_decoder_checked = False

    def choose_decoder_path(self) -> None:
        """Decide (again) whether single-sequence CPU steps run natively, from the weights as
        loaded now and ROOFLM_NATIVE_DECODE; the first forward does it when nobody did."""
        self.native_decoder = NativeDecoder.build(self)
        self._native_decoder_checked = True

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata):
        if not self._native_decoder_checked:
            self.choose_decoder_path()
        if self.native_decoder is not None:
            hidden = self.native_decoder.forward(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: Optional[int] = None,
                 backend: Optional[AttentionBackend] = None, kernels: Kernels = TORCH_KERNELS,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.heads = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)  # this rank's
        self.model = self.make_model(cfg, max_positions or cfg.max_position_embeddings, backend, kernels, tp)
        # Why this model must run eagerly (no CUDA graphs), or None (model/decoder.py sets it where
        # attention falls back to the torch reference).
        self.graph_unsafe_reason: Optional[str] = getattr(self.model, "graph_unsafe_reason", None)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = tp_layers.lm_head(cfg.hidden_size, cfg.vocab_size, tp, tied)
        self.gemv = kernels.gemv  # as LlamaDecoderLayer.gemv: the LM head of one token
        self.linear = kernels.linear  # the LM head's matmul (layers/kernels.py), after the GEMV's one token
        # Tied embeddings read from quantized blocks: the embedding is dequantized (a lookup reads
        # one row per token) and the LM head, which reads all of it every step, stays quantized.
        self.tied_head_quant = None
        # A checkpoint's static FP8 K/V scales, [layers, 2 (K, V)] fp32 on the host, or None
        # (quant/checkpoint.py's kv_cache_scheme); the model runner puts them in the FP8 cache.
        self.checkpoint_kv_scales: Optional[torch.Tensor] = None

    def make_model(self, cfg: ModelConfig, max_positions: int, backend: Optional[AttentionBackend],
                   kernels: Kernels, tp: TPGroup) -> "LlamaModel":
        """The decoder stack; a family whose parts differ builds its own (model/decoder.py)."""
        return LlamaModel(cfg, max_positions, backend, kernels, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; logits are computed only where needed."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[rows, hidden] -> fp32 logits [rows, vocab]. out: an fp32 buffer to widen them into
        (a CUDA graph's output, shared by every captured batch size) instead of a new tensor."""
        logits = self._head(hidden)
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
        """Copy HF-named tensors into the (fused) parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints still store the head; the embedding is used
            if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                self._load_kv_scale(name, tensor)
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
        for module in self.modules():
            if isinstance(module, FusedLinear):
                module.finish_loading()
        self.disable_gemv_where_quantized()
        missing = [n for n in self._expected_weight_names() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

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
        fused_prefixes = tuple(n + "." for n, m in self.named_modules() if isinstance(m, FusedLinear))
        for name, _ in self.named_parameters():
            if not name.startswith(fused_prefixes):
                yield name

    def dummy_weights(self, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights init_dummy_weights draws for the whole (single-device) model, as HF-named
        checkpoint tensors, fused ones split again: a tensor-parallel rank loads its part of the
        same weights through load_weights. Each whole tensor exists once, briefly, on this device."""
        sample = next(self.parameters())
        with torch.device("meta"):
            whole = type(self)(self.cfg, max_positions=1)
        gen = torch.Generator(device=sample.device).manual_seed(seed)
        fused = {name: m for name, m in whole.named_modules() if isinstance(m, FusedLinear)}
        for name, param in whole.named_parameters():
            tensor = torch.empty(param.shape, dtype=sample.dtype, device=sample.device)
            _dummy_fill(name, tensor, gen)
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


def _dummy_fill(name: str, tensor: torch.Tensor, gen: torch.Generator) -> None:
    with torch.no_grad():
        if name.endswith("norm.weight") or "layernorm" in name:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=gen)


def _row_gemv(gemv, x: torch.Tensor, linear: Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ W^T in one GEMV. A row-parallel layer holds a slice of W's columns: rank 0
    adds the residual to its partial sum, the others add nothing, and one all-reduce sums them."""
    if isinstance(linear, tp_layers.RowParallelLinear):
        return linear.tp.all_reduce(gemv(x, linear.weight, residual=linear.partial_with_residual(residual)))
    return gemv(x, linear.weight, residual=residual)


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
