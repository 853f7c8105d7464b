"""How much GPU memory a model needs, for inference (weights + paged KV cache) and for training.

Inference. Weights take parameters x bytes per parameter (split over tensor
parallelism). Every token of every sequence then holds its K and V in every
layer: 2 x layers x KV heads x head_dim x bytes, so grouped-query attention,
with fewer KV heads than query heads, shrinks the cache by the group factor.
LLaMA-7B (32 layers, 32 KV heads of 128) in bf16 holds 0.5 MiB per token,
4.3 GB for one 8,192-token sequence. What is left of the GPU after the weights
and an activation reserve becomes fixed-size blocks of `block_size` tokens;
a sequence of L tokens needs ceil(L / block_size) of them.

Training with Adam in mixed precision keeps, per parameter, the bf16 weight
(2 B), its bf16 gradient (2 B), an fp32 master copy (4 B) and Adam's two fp32
moments (8 B): 16 bytes per parameter before a single activation (the ZeRO
paper's accounting), so a 7B model needs ~112 GB of states alone. DDP
replicates all of it on every GPU; FSDP (ZeRO-3, full sharding) divides it by
the number of GPUs and adds the one unit it gathers at a time.

Activations are what the backward pass needs from the forward one. Per token
and per decoder layer, in the 16-bit activation dtype (a Llama block, no
dropout; the same accounting as Korthikanti et al. 2022, which gives 34*h for
a GPT block with dropout and a 4h GeLU MLP):
    attention RMSNorm input           h
    QKV projection input              h
    q, k, v (after rotary)            q + 2*kv
    attention output (o_proj input)   q
    MLP RMSNorm input                 h
    gate/up projection input          h
    gate and up outputs               2*I
    SiLU(gate)                        I
    SiLU(gate)*up (down_proj input)   I
  = 4h + 2q + 2kv + 4I elements, plus an fp32 log-sum-exp per query head for
FlashAttention's backward. Eager attention also keeps the softmax matrix,
num_heads x seq_len elements per token. Once per model: the final norm input,
the LM head input and the logits, kept in bf16 and again in fp32 for the
cross-entropy. Full activation checkpointing keeps only each layer's input
(h per token per layer) and recomputes one layer at a time during backward.
Selective checkpointing (torchtitan's op-level policy, rooflm train's
`selective`) keeps each layer's input and the outputs of its matmuls and
attention (q, k, v; the attention output and its log-sum-exp; o_proj's; gate and
up; down's) = 3h + 2q + 2kv + 2I elements, recomputing the element-wise ops
(norms, rotary, SiLU*up) one layer at a time during backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from rooflm.config import ModelConfig, resolve_max_num_seqs, step_activation_bytes
from rooflm.perf.roofline import KV_CACHE_BYTES, WEIGHT_FORMATS, kv_bytes_per_token_per_gpu


if TYPE_CHECKING:  # imported where used: the CLI builds its parser from this module without the engine
    from rooflm.engine.kv_groups import KVLayout

@dataclass(frozen=True)
class ParamCounts:
    """Where a model's parameters sit: the linear layers are what quantization converts."""

    linear: int  # q/k/v/o and gate/up/down of every layer, plus an untied LM head
    embedding: int  # the embedding table (also the LM head when tied)
    other: int  # norms and biases
    per_layer: int  # one decoder layer, everything included

    @property
    def total(self) -> int:
        return self.linear + self.embedding + self.other


def param_counts(config: ModelConfig) -> ParamCounts:
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    attn_linear = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    # An MoE layer holds all its experts (and router, shared expert) in memory, whatever a token reads.
    moe_layers = config.num_moe_layers
    moe_mlp = config.moe_layer_params(config.num_experts) if moe_layers else 0
    mlps = (config.num_hidden_layers - moe_layers) * 3 * h * inter + moe_layers * moe_mlp
    layer_linear = attn_linear + (moe_mlp if moe_layers else 3 * h * inter)  # the largest layer
    layer_other = 2 * h  # the two RMSNorm weights
    if config.attention_bias:
        layer_other += config.q_size + 2 * config.kv_size
    if config.qk_norm:
        layer_other += 2 * config.head_dim
    if config.o_proj_bias:  # gpt-oss: o_proj's bias and one sink logit per query head
        layer_other += h
    if config.attention_sinks:
        layer_other += config.num_attention_heads
    head = 0 if config.tie_word_embeddings else vocab * h
    counts = ParamCounts(
        linear=config.num_hidden_layers * attn_linear + mlps + head,
        embedding=vocab * h,
        other=config.num_hidden_layers * layer_other + h,  # + final norm
        per_layer=layer_linear + layer_other,
    )
    assert counts.total == config.num_params(), "parameter accounting disagrees with ModelConfig"
    return counts


def weight_bytes(config: ModelConfig, dtype: str = "bf16", tp: int = 1) -> float:
    """Bytes of weights on one GPU. Quantization converts the linear layers only."""
    if dtype not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight dtype {dtype!r}; known: {', '.join(WEIGHT_FORMATS)}")
    counts = param_counts(config)
    dense_bytes = 4.0 if dtype == "fp32" else 2.0
    # Linear layers and the vocab-parallel embedding split over TP; norms are replicated.
    return ((counts.linear * WEIGHT_FORMATS[dtype].bytes_per_param
             + counts.embedding * dense_bytes) / tp
            + counts.other * dense_bytes)


def stage_weight_bytes(config: ModelConfig, dtype: str, tp: int, num_layers: int, first: bool,
                       last: bool) -> float:
    """Bytes of weights on one GPU of a pipeline stage of num_layers layers (distributed/pipeline.py):
    stage 0 also holds the embedding and the LM head, the last stage the final norm. The layers
    are counted as equal shares (an MoE model's dense and sparse layers as their mean)."""
    if dtype not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight dtype {dtype!r}; known: {', '.join(WEIGHT_FORMATS)}")
    counts = param_counts(config)
    dense_bytes = 4.0 if dtype == "fp32" else 2.0
    head = 0 if config.tie_word_embeddings else counts.embedding
    share = num_layers / config.num_hidden_layers
    linear = (counts.linear - head) * share + (head if first else 0)
    embedding = counts.embedding if first else 0
    other = (counts.other - config.hidden_size) * share + (config.hidden_size if last else 0)
    return (linear * WEIGHT_FORMATS[dtype].bytes_per_param + embedding * dense_bytes) / tp + other * dense_bytes


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's GPU: its layers, weights and KV blocks (each GPU of its TP group)."""

    stage: int
    layers: tuple[int, int]  # [start, end)
    weights: float
    kv_pool: float
    block_bytes: float
    num_blocks: int  # what this stage's pool could hold; the engine takes the least over stages


@dataclass(frozen=True)
class InferenceMemory:
    """The memory plan of one GPU serving a model, all sizes in bytes."""

    num_params: int
    gpu_mem: float
    usable: float  # gpu_mem x gpu_memory_utilization
    weights: float
    activation_reserve: float
    max_num_seqs: int  # the sequence cap the reserve holds logits for
    kv_pool: float  # what is left for the KV cache
    kv_bytes_per_token: float
    kv_bytes_per_seq: float  # at `context` tokens
    block_size: int
    block_bytes: float
    num_blocks: int
    context: int
    blocks_per_seq: int
    max_concurrent_seqs: int  # sequences of `context` tokens that fit at once
    max_cached_tokens: int
    # KV cache groups (engine/kv_groups.py): sliding-window layers holding only their window, the
    # engine's default. A block then holds kv_layout.group_size layers, not all of them.
    kv_layout: "KVLayout" = None
    hybrid_num_blocks: int = 0
    hybrid_blocks_per_seq: int = 0
    hybrid_concurrent_seqs: int = 0  # the same as max_concurrent_seqs without sliding layers
    # Pipeline parallelism: every stage's plan; the figures above are then the stage with the
    # fewest blocks (every stage's pool has as many blocks as the least: one block table).
    stages: tuple[StageMemory, ...] = ()


def inference_memory(config: ModelConfig, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                     context: int = 4096, gpu_mem_gb: float = 80.0, tp: int = 1,
                     block_size: int = 16, gpu_memory_utilization: float = 0.9,
                     max_num_batched_tokens: int = 2048, max_num_seqs: Optional[int] = None,
                     pp: int = 1) -> InferenceMemory:
    """Plan one GPU's memory: weights, an activation reserve, and KV blocks in what remains.
    max_num_seqs: None is the engine's default on a GPU of gpu_mem_gb. pp > 1: the pipeline
    stage that holds the fewest blocks (InferenceMemory.stages has each)."""
    if pp > 1:
        return _pipeline_memory(config, weight_dtype, kv_dtype, context, gpu_mem_gb, tp, block_size,
                                gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, pp)
    max_num_seqs = resolve_max_num_seqs(max_num_seqs, "cuda", gpu_mem_gb)
    if kv_dtype not in KV_CACHE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {', '.join(KV_CACHE_BYTES)}")
    gpu_mem = gpu_mem_gb * 1e9
    usable = gpu_mem * gpu_memory_utilization
    weights = weight_bytes(config, weight_dtype, tp)
    act_bytes = 4.0 if weight_dtype == "fp32" else 2.0
    reserve = step_activation_bytes(config, max_num_batched_tokens, max_num_seqs, act_bytes, tp)
    kv_pool = max(usable - weights - reserve, 0.0)
    per_token = kv_bytes_per_token_per_gpu(config, KV_CACHE_BYTES[kv_dtype], tp)
    block_bytes = block_size * per_token
    num_blocks = int(kv_pool // block_bytes)
    blocks_per_seq = math.ceil(context / block_size)
    layout = model_kv_layout(config, context)
    hybrid_blocks = int(kv_pool // (block_bytes * layout.group_size / config.num_hidden_layers))
    from rooflm.engine.kv_groups import blocks_per_seq as group_blocks_per_seq
    hybrid_per_seq = group_blocks_per_seq(layout, context, block_size)
    return InferenceMemory(
        kv_layout=layout, hybrid_num_blocks=hybrid_blocks, hybrid_blocks_per_seq=hybrid_per_seq,
        hybrid_concurrent_seqs=hybrid_blocks // hybrid_per_seq,
        num_params=config.num_params(), gpu_mem=gpu_mem, usable=usable, weights=weights,
        activation_reserve=reserve, max_num_seqs=max_num_seqs, kv_pool=kv_pool, kv_bytes_per_token=per_token,
        kv_bytes_per_seq=context * per_token, block_size=block_size, block_bytes=block_bytes,
        num_blocks=num_blocks, context=context, blocks_per_seq=blocks_per_seq,
        max_concurrent_seqs=num_blocks // blocks_per_seq,
        max_cached_tokens=num_blocks * block_size)


def _pipeline_memory(config: ModelConfig, weight_dtype: str, kv_dtype: str, context: int, gpu_mem_gb: float,
                     tp: int, block_size: int, gpu_memory_utilization: float, max_num_batched_tokens: int,
                     max_num_seqs: Optional[int], pp: int) -> InferenceMemory:
    """inference_memory over pp stages: each holds its layers' weights and KV (the engine's
    stage layout, the even split or ROOFLM_PP_LAYER_PARTITION); hybrid KV groups are off."""
    from dataclasses import replace

    from rooflm.distributed.pipeline import configured_partition
    from rooflm.engine.kv_groups import single_group

    whole = inference_memory(config, weight_dtype, kv_dtype, context, gpu_mem_gb, tp, block_size,
                             gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
    stages = []
    for s, (start, end) in enumerate(configured_partition(config.num_hidden_layers, pp)):
        weights = stage_weight_bytes(config, weight_dtype, tp, end - start, s == 0, s == pp - 1)
        pool = max(whole.usable - weights - whole.activation_reserve, 0.0)
        block_bytes = whole.block_bytes * (end - start) / config.num_hidden_layers
        stages.append(StageMemory(s, (start, end), weights, pool, block_bytes, int(pool // block_bytes)))
    least = min(stages, key=lambda st: st.num_blocks)
    num_blocks = least.num_blocks
    return replace(whole, weights=least.weights, kv_pool=least.kv_pool, block_bytes=least.block_bytes,
                   kv_bytes_per_token=least.block_bytes / block_size, kv_bytes_per_seq=context * least.block_bytes
                   / block_size, num_blocks=num_blocks, max_concurrent_seqs=num_blocks // whole.blocks_per_seq,
                   max_cached_tokens=num_blocks * block_size, kv_layout=single_group(config.num_hidden_layers),
                   hybrid_num_blocks=0, hybrid_blocks_per_seq=0, hybrid_concurrent_seqs=0, stages=tuple(stages))


def model_kv_layout(config: ModelConfig, max_model_len: int) -> "KVLayout":
    """The KV cache groups the engine makes of this model's layers (model_runner.set_kv_layout)."""
    from rooflm.engine.kv_groups import kv_layout, single_group
    from rooflm.model.spec import layer_windows

    try:
        return kv_layout(layer_windows(config), max_model_len)
    except ValueError:  # layer types rooflm does not run: the engine would refuse the model
        return single_group(config.num_hidden_layers)


# Training: bytes per parameter of each kind of state, by training precision.
# bf16 / fp16: mixed precision (16-bit weights and grads, fp32 master and Adam).
# fp32: plain fp32 training, no master copy.
_TRAIN_STATE_BYTES = {
    "bf16": {"weights": 2, "gradients": 2, "master": 4, "adam": 8},
    "fp16": {"weights": 2, "gradients": 2, "master": 4, "adam": 8},
    "fp32": {"weights": 4, "gradients": 4, "master": 0, "adam": 8},
}


@dataclass(frozen=True)
class TrainingMemory:
    """Memory of training one model, in bytes; `*_per_gpu` figures are for one of `num_gpus`."""

    num_params: int
    num_gpus: int
    micro_batch: int
    seq_len: int
    dtype: str
    flash_attention: bool
    weights: float
    gradients: float
    master_weights: float
    adam_moments: float
    activations: float  # no checkpointing, one micro-batch
    activations_checkpointed: float  # full activation checkpointing, one micro-batch
    activations_selective: float  # selective checkpointing (matmul and attention outputs kept)
    fsdp_gathered: float  # transient, FSDP only: the largest unit gathered, weights and grads

    @property
    def states(self) -> float:
        return self.weights + self.gradients + self.master_weights + self.adam_moments

    @property
    def state_bytes_per_param(self) -> float:
        return self.states / self.num_params

    def activations_for(self, checkpointing: Union[bool, str] = False) -> float:
        """One micro-batch's activations: checkpointing False/"none", True/"full" or "selective"."""
        mode = {False: "none", True: "full"}.get(checkpointing, checkpointing)
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"checkpointing must be none, full or selective, got {checkpointing!r}")
        return {"none": self.activations, "full": self.activations_checkpointed,
                "selective": self.activations_selective}[mode]

    def ddp_per_gpu(self, checkpointing: Union[bool, str] = False) -> float:
        """DDP: every GPU holds all states plus the activations of its own micro-batch."""
        return self.states + self.activations_for(checkpointing)

    def fsdp_per_gpu(self, checkpointing: Union[bool, str] = False) -> float:
        """FSDP full sharding: states / N, the gathered unit, and this GPU's activations."""
        return self.states / self.num_gpus + self.fsdp_gathered + self.activations_for(checkpointing)


def activation_bytes_per_token_per_layer(config: ModelConfig, seq_len: int, act_bytes: float = 2.0,
                                         flash_attention: bool = True) -> float:
    """Bytes one token leaves behind in one decoder layer for the backward pass (see module doc)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    elements = 4 * h + 2 * q + 2 * kv + 4 * inter
    per_token = elements * act_bytes + 4 * config.num_attention_heads  # fp32 log-sum-exp
    if not flash_attention:
        # The materialized softmax: one row of seq_len scores per head for this query.
        per_token += config.num_attention_heads * seq_len * act_bytes
    return per_token


def training_memory(config: ModelConfig, num_gpus: int = 1, micro_batch: int = 1,
                    seq_len: int = 2048, dtype: str = "bf16",
                    flash_attention: bool = True) -> TrainingMemory:
    """States and activations of training with Adam, for DDP or FSDP over `num_gpus`."""
    if dtype not in _TRAIN_STATE_BYTES:
        raise ValueError(f"training dtype must be one of {', '.join(_TRAIN_STATE_BYTES)}, got {dtype!r}")
    if num_gpus < 1 or micro_batch < 1 or seq_len < 1:
        raise ValueError("num_gpus, micro_batch and seq_len must be >= 1")
    counts = param_counts(config)
    n = counts.total
    per_param = _TRAIN_STATE_BYTES[dtype]
    act_bytes = 4.0 if dtype == "fp32" else 2.0
    tokens = micro_batch * seq_len
    layers = config.num_hidden_layers

    per_layer_token = activation_bytes_per_token_per_layer(config, seq_len, act_bytes, flash_attention)
    # Final norm input, LM head input, the logits and their fp32 copy for the loss.
    head_token = 2 * config.hidden_size * act_bytes + config.vocab_size * (act_bytes + 4)
    activations = tokens * (layers * per_layer_token + head_token)
    # Checkpointing keeps each layer's input and recomputes one whole layer during backward.
    checkpointed = tokens * (layers * config.hidden_size * act_bytes + per_layer_token + head_token)
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    kept = (3 * h + 2 * q + 2 * kv + 2 * inter) * act_bytes + 4 * config.num_attention_heads
    # The recomputed layer is transient; with few layers it could exceed keeping everything.
    selective = min(tokens * (layers * kept + per_layer_token + head_token), activations)

    # FSDP gathers one unit (a decoder layer, or the embedding / LM head, whichever is larger)
    # in the working precision, and holds its unsharded gradient until the reduce-scatter.
    largest_unit = max(counts.per_layer, counts.embedding)
    gathered = largest_unit * (per_param["weights"] + per_param["gradients"]) if num_gpus > 1 else 0.0

    return TrainingMemory(
        num_params=n, num_gpus=num_gpus, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype,
        flash_attention=flash_attention,
        weights=n * per_param["weights"], gradients=n * per_param["gradients"],
        master_weights=n * per_param["master"], adam_moments=n * per_param["adam"],
        activations=activations, activations_checkpointed=checkpointed, activations_selective=selective,
        fsdp_gathered=gathered)


def default_gpu_mem_gb(gpu_key: Optional[str]) -> float:
    """Memory of a table GPU, or 80 GB (an H100 or A100) when none is named."""
    if gpu_key is None:
        return 80.0
    from rooflm.perf.gpus import get_gpu

    return get_gpu(gpu_key).mem_gb
