"""FLOPs and bytes of one forward step of a Llama-family model, and where that step sits on a roofline.

The model counts, for every operation of a step, the floating-point work it
must do and the bytes it must move to and from device memory, assuming each
operation is one kernel that reads its inputs once and writes its outputs once
(the compulsory traffic; caches are not credited). An operation's floor time on
a GPU is the larger of FLOPs / peak FLOP/s and bytes / bandwidth; a step's floor
is the sum of its operations' floors, because kernels of one step run one after
another. Measured time over that floor is the gap an optimization can close.

Conventions, the field's usual ones:
  * A matmul of an [M, K] activation by a [K, N] weight is 2*M*K*N FLOPs
    (one multiply and one add per multiply-accumulate). It reads the weight
    once, the activation once, and writes the output once.
  * Attention FLOPs count the two matmuls only, QK^T and PV: 4 * head_dim *
    num_heads FLOPs per (query, key) pair. Prefill is causal, so a fresh
    sequence of S tokens has S(S+1)/2 pairs, about half of the dense 4*S^2*D*H.
    Attention bytes are what a FlashAttention-style kernel must move: Q read,
    O written, and K and V of every attended position read once per KV head
    (the query heads of a GQA group share that read).
  * Element-wise FLOPs, with an exp counted as one FLOP: RMSNorm 4 per element,
    residual add 1, SiLU-and-mul 5, rotary embedding 3, sampling 8 per logit.
    They run on CUDA cores, so their roof is the fp32 (non-tensor) rate.
  * The LM head and the sampler run only on the tokens that are sampled: every
    decode token, and the last prompt token of a prefill that finishes this step.
  * Weight-only quantization (int8, int4) shrinks the bytes of the linear
    layers but the matmuls still run in bf16; fp8 is W8A8 and runs on fp8 tensor
    cores. Embeddings and norms stay in the activation dtype, as gpt-fast does.
  * Tensor parallelism over N GPUs shards attention heads, the MLP's
    intermediate dimension and the vocabulary (Megatron-style); norms, residual
    adds and the embedding output are replicated. Each layer then needs two
    all-reduces of the hidden states, counted on the GPU-to-GPU link, not HBM.

`step_cost` is pure arithmetic over a few integers so the engine can call it
every step to turn a measured step time into achieved MBU and MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rooflm.config import ModelConfig
from rooflm.perf.gpus import BLOCK_DOT_TILE, INT8_ONE_TOKEN, GpuSpec


@dataclass(frozen=True)
class WeightFormat:
    """How a weight dtype is stored and which tensor-core format its matmuls run in."""

    bytes_per_param: float
    compute_dtype: str
    note: str


# int4 is group-wise with group size 128 and a bf16 scale and zero point per
# group (gpt-fast's and AWQ's layout): 0.5 + 4/128 bytes per parameter. int8
# weight-only has one bf16 scale per output channel, too small to count.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat(4.0, "fp32", "fp32 weights, fp32 matmuls"),
    "bf16": WeightFormat(2.0, "bf16", "bf16 weights, bf16 tensor cores"),
    "fp16": WeightFormat(2.0, "bf16", "fp16 weights, fp16 tensor cores"),
    "fp8": WeightFormat(1.0, "fp8", "fp8 weights and activations (W8A8), fp8 tensor cores"),
    "int8": WeightFormat(1.0, "bf16", "int8 weight-only, dequantized into bf16 matmuls"),
    "int4": WeightFormat(0.5 + 4.0 / 128, "bf16",
                         "int4 weight-only, group 128, dequantized into bf16 matmuls"),
    # rooflm's W4A16 kernel layout (rooflm/kernels/w4a16.py): a bf16 scale and zero per group.
    **{f"int4-g{g}": WeightFormat(0.5 + 4.0 / g, "bf16", f"int4 weight-only, group {g} (rooflm --quantization "
                                                          f"int4-g{g}), dequantized into bf16 matmuls")
       for g in (32, 64, 128)},
    # GGUF blocks the engine multiplies without dequantizing (config.py's quantization auto), at
    # the bytes the file stores, scales included; activations are bf16 (W4A16/W8A16 on CUDA, the
    # block kernels on the CPU).
    **{kind.lower(): WeightFormat(block_bytes / values, "bf16", f"GGUF {kind} blocks, "
                                  f"{8 * block_bytes / values:g} bits a weight, bf16 activations")
       for kind, block_bytes, values in (("Q4_0", 18, 32), ("Q4_1", 20, 32), ("Q8_0", 34, 32),
                                         ("Q4_K", 144, 256))},
}

KV_CACHE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0}

# FLOPs per element of the element-wise kernels (see the module docstring).
_RMSNORM_FLOPS = 4
_ROPE_FLOPS = 3
_SILU_MUL_FLOPS = 5
_SAMPLING_FLOPS = 8

# Kinds of operation, each with its own roof.
MATMUL = "matmul"  # tensor cores at the weight format's compute dtype
ATTENTION = "attention"  # tensor cores in the activations' dtype (bf16; fp32 models: fp32)
VECTOR = "vector"  # CUDA cores (fp32 rate)
COMM = "comm"  # GPU-to-GPU link under tensor parallelism


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes of one operation, summed over all layers of one step.

    `bytes` is device-memory traffic; for a COMM op it is the bytes each GPU
    sends over the link instead. `weight_bytes` and `kv_bytes` are the parts of
    `bytes` that are weights and KV cache, so a report can say what dominates.
    """

    name: str
    kind: str
    flops: float
    bytes: float
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    latency_s: float = 0.0  # COMM: the collectives' fixed cost, paid per message whatever its size
    rows: int = 0  # MATMUL: tokens each weight row meets (a CPU's block kernels are slower below 4); 0: many

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte moved."""
        return self.flops / self.bytes if self.bytes > 0 else math.inf


@dataclass(frozen=True)
class StepCost:
    """The cost of one forward step on one GPU (one tensor-parallel rank)."""

    ops: tuple[OpCost, ...]
    num_tokens: int  # tokens that go through the layers this step
    num_sampled: int  # tokens that go through the LM head and the sampler
    compute_dtype: str  # tensor-core format of the linear layers
    flops: float  # all FLOPs of the step
    bytes: float  # device-memory bytes of the step (link traffic excluded)
    comm_bytes: float  # bytes sent per GPU over the link (0 without TP)

    def floor_seconds(self, gpu: GpuSpec) -> float:
        """Sum of the operations' floor times on `gpu`."""
        return sum(op_roofline(op, gpu, self.compute_dtype).floor_s for op in self.ops)

    def mbu(self, elapsed_s: float, gpu: GpuSpec) -> float:
        """Model bandwidth utilization: bytes the step had to move / elapsed / peak bandwidth."""
        return self.bytes / elapsed_s / gpu.mem_bw

    def mfu(self, elapsed_s: float, gpu: GpuSpec) -> float:
        """Model FLOPs utilization against the tensor-core peak of the compute dtype."""
        return self.flops / elapsed_s / gpu.peak_flops(self.compute_dtype)


def causal_pairs(num_new: int, num_cached: int = 0, window: Optional[int] = None) -> int:
    """(query, key) pairs that `num_new` prompt tokens attend to after `num_cached` cached ones.

    New token i (0-based) sees the num_cached + i + 1 positions up to and
    including itself, or at most `window` of them under sliding-window
    attention. Without a window: n*p + n(n+1)/2.
    """
    n, p = num_new, num_cached
    if window is None:
        return n * p + n * (n + 1) // 2
    # The first k new tokens see fewer than `window` positions; the rest see exactly `window`.
    k = min(max(window - p, 0), n)
    return k * p + k * (k + 1) // 2 + (n - k) * window


def matmul_cost(m: int, k: int, n: int, elem_bytes: float = 2.0, name: str = "matmul") -> OpCost:
    """[m, k] x [k, n]: 2mkn FLOPs; reads both operands once and writes the [m, n] output once."""
    return OpCost(name, MATMUL, 2.0 * m * k * n, (m * k + k * n + m * n) * elem_bytes)


def layernorm_cost(tokens: int, hidden: int, elem_bytes: float = 2.0, rms: bool = False,
                   name: str = "") -> OpCost:
    """LayerNorm (mean, variance, normalize, scale, shift: ~7 FLOPs per element) or RMSNorm
    (4 per element) over [tokens, hidden]: reads x and the weights, writes y."""
    flops_per_elem = _RMSNORM_FLOPS if rms else 7
    weight_elems = hidden if rms else 2 * hidden
    return OpCost(name or ("rmsnorm" if rms else "layernorm"), VECTOR,
                  flops_per_elem * tokens * hidden,
                  (2 * tokens * hidden + weight_elems) * elem_bytes)


@dataclass(frozen=True)
class _ShardedShape:
    """The per-GPU widths of a model under tensor parallelism."""

    hidden: int
    q: int
    kv: int
    intermediate: int
    vocab: int


def _shard(config: ModelConfig, tp: int) -> _ShardedShape:
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if config.num_attention_heads % tp:
        raise ValueError(f"{config.num_attention_heads} attention heads do not split over tp={tp}")
    if config.intermediate_size % tp:
        raise ValueError(f"intermediate size {config.intermediate_size} does not split over tp={tp}")
    kv_heads = config.num_key_value_heads
    if kv_heads >= tp:
        if kv_heads % tp:
            raise ValueError(f"{kv_heads} KV heads do not split over tp={tp}")
        kv_heads_local = kv_heads // tp
    else:
        # Fewer KV heads than GPUs: each GPU keeps a replica of the one KV head its query heads use.
        if tp % kv_heads:
            raise ValueError(f"{kv_heads} KV heads cannot be replicated evenly over tp={tp}")
        kv_heads_local = 1
    return _ShardedShape(
        hidden=config.hidden_size,
        q=config.q_size // tp,
        kv=kv_heads_local * config.head_dim,
        intermediate=config.intermediate_size // tp,
        vocab=math.ceil(config.vocab_size / tp),
    )


def kv_bytes_per_token_per_gpu(config: ModelConfig, kv_bytes: float, tp: int = 1) -> float:
    """K and V of every layer for one token on one GPU: 2 x layers x local KV heads x head_dim x bytes."""
    return 2 * config.num_hidden_layers * _shard(config, tp).kv * kv_bytes


# One NCCL all-reduce of a few kB between GPUs of one NVLink host, launched inside a CUDA
# graph: roughly 5-10 us on H100s by nccl-tests-style small-message figures (an estimate:
# benchmarks/tp.sh measures the device's own and prints it; --allreduce-latency-us sets it).
ALLREDUCE_LATENCY_S = 8e-6


def step_cost(
    config: ModelConfig,
    num_decode_seqs: int = 0,
    decode_context_tokens: int = 0,
    prefill_tokens: int = 0,
    prefill_attention_pairs: Optional[int] = None,
    prefill_context_tokens: Optional[int] = None,
    num_sampled_prefills: int = 0,
    weight_bytes: float = 2.0,
    kv_bytes: float = 2.0,
    act_bytes: float = 2.0,
    tp: int = 1,
    compute_dtype: str = "bf16",
    embed_bytes: Optional[float] = None,
    head_bytes: Optional[float] = None,
    allreduce_latency_s: Optional[float] = None,
) -> StepCost:
    """FLOPs and bytes of one forward step of a batch, per GPU.

    The batch is described the way a scheduler sees it:
      num_decode_seqs: sequences decoding one token each this step.
      decode_context_tokens: sum over those sequences of the positions each one
        attends to (its cached tokens plus the new one): the KV cache read.
      prefill_tokens: prompt tokens computed this step (all chunks together).
      prefill_attention_pairs: sum over prefill chunks of causal_pairs(new,
        cached); default: one fresh sequence of prefill_tokens tokens.
      prefill_context_tokens: sum over prefill chunks of cached + new tokens,
        the K/V the chunks' attention reads; default: prefill_tokens.
      num_sampled_prefills: prefill chunks that end their prompt this step, so
        their last token is sampled.
    weight_bytes / kv_bytes / act_bytes: bytes per weight parameter, per KV
    element and per activation element. compute_dtype: the tensor-core format
    of the linear layers (see WEIGHT_FORMATS). embed_bytes: bytes per
    embedding parameter, by default the activation dtype (max of weight and
    act bytes: quantization leaves embeddings alone). head_bytes: bytes per LM head
    weight as stored, by default embed_bytes when tied, else weight_bytes (an engine
    that keeps a tied head quantized says so). allreduce_latency_s: the fixed cost of one
    collective under tensor parallelism (default ALLREDUCE_LATENCY_S).
    """
    if allreduce_latency_s is None:
        allreduce_latency_s = ALLREDUCE_LATENCY_S
    if prefill_attention_pairs is None:
        prefill_attention_pairs = causal_pairs(prefill_tokens, 0, config.sliding_window)
    if prefill_context_tokens is None:
        prefill_context_tokens = prefill_tokens
    if embed_bytes is None:
        embed_bytes = max(weight_bytes, act_bytes)

    shape = _shard(config, tp)
    h, q, kv, inter, vocab = shape.hidden, shape.q, shape.kv, shape.intermediate, shape.vocab
    layers = config.num_hidden_layers
    a = act_bytes
    tokens = num_decode_seqs + prefill_tokens  # T: rows through every layer
    sampled = num_decode_seqs + num_sampled_prefills  # S: rows through the LM head
    ops: list[OpCost] = []

    # Embedding: a gather of T rows; the table itself is not streamed.
    embed_read = tokens * h * embed_bytes / tp
    ops.append(OpCost("embedding", VECTOR, 0.0, embed_read + tokens * h * a,
                      weight_bytes=embed_read))

    # Norms: two RMSNorms per layer and the final one, over the full hidden size
    # on every GPU; Qwen3 adds an RMSNorm over each head of q and k.
    norm_count = 2 * layers + 1
    norm_flops = norm_count * _RMSNORM_FLOPS * tokens * h
    norm_weights = norm_count * h * a
    norm_bytes = norm_count * 2 * tokens * h * a + norm_weights
    if config.qk_norm:
        qk_elems = tokens * (q + kv)
        norm_flops += layers * _RMSNORM_FLOPS * qk_elems
        norm_weights += layers * 2 * config.head_dim * a
        norm_bytes += layers * (2 * qk_elems * a + 2 * config.head_dim * a)
    ops.append(OpCost("norms", VECTOR, norm_flops, norm_bytes, weight_bytes=norm_weights))

    # QKV projection: [T, h] x [h, q + 2kv], column-parallel.
    qkv_out = q + 2 * kv
    w = h * qkv_out * weight_bytes
    flops = 2 * tokens * h * qkv_out
    traffic = w + tokens * h * a + tokens * qkv_out * a
    if config.attention_bias:
        flops += tokens * qkv_out
        traffic += qkv_out * a
    ops.append(OpCost("qkv_proj", MATMUL, layers * flops, layers * traffic, weight_bytes=layers * w, rows=tokens))

    # Rotary embedding on q and k, fused with writing the new K and V into the paged cache.
    kv_write = tokens * 2 * kv * kv_bytes
    ops.append(OpCost(
        "rope + kv write", VECTOR,
        layers * _ROPE_FLOPS * tokens * (q + kv),
        layers * (tokens * qkv_out * a + tokens * q * a + kv_write),
        kv_bytes=layers * kv_write))

    # Attention: decode rows attend to their whole context, prefill rows causally.
    pairs = decode_context_tokens + prefill_attention_pairs
    kv_read = (decode_context_tokens + prefill_context_tokens) * 2 * kv * kv_bytes
    ops.append(OpCost(
        "attention", ATTENTION,
        layers * 4 * q * pairs,
        layers * (2 * tokens * q * a + kv_read),
        kv_bytes=layers * kv_read))

    # Output projection: [T, q] x [q, h], row-parallel.
    w = q * h * weight_bytes
    ops.append(OpCost("o_proj", MATMUL, layers * 2 * tokens * q * h,
                      layers * (w + tokens * q * a + tokens * h * a), weight_bytes=layers * w, rows=tokens))

    # Residual adds: two per layer, each reads two [T, h] tensors and writes one.
    # (A fused add+RMSNorm kernel would save one of those passes.)
    ops.append(OpCost("residual adds", VECTOR, 2 * layers * tokens * h,
                      2 * layers * 3 * tokens * h * a))

    # The dense MLPs (every layer of a dense model; an MoE model's mlp_only layers).
    moe_layers = config.num_moe_layers
    dense = layers - moe_layers
    if dense:
        # Gate and up projections as one [T, h] x [h, 2I] matmul, column-parallel.
        w = h * 2 * inter * weight_bytes
        ops.append(OpCost("gate_up_proj", MATMUL, dense * 2 * tokens * h * 2 * inter,
                          dense * (w + tokens * h * a + tokens * 2 * inter * a),
                          weight_bytes=dense * w, rows=tokens))

        # SiLU(gate) * up: reads [T, 2I], writes [T, I].
        ops.append(OpCost("act (silu*mul)", VECTOR, dense * _SILU_MUL_FLOPS * tokens * inter,
                          dense * 3 * tokens * inter * a))

        # Down projection: [T, I] x [I, h], row-parallel.
        w = inter * h * weight_bytes
        ops.append(OpCost("down_proj", MATMUL, dense * 2 * tokens * inter * h,
                          dense * (w + tokens * inter * a + tokens * h * a), weight_bytes=dense * w,
                          rows=tokens))
    if moe_layers:
        ops.extend(_moe_ops(config, moe_layers, tokens, weight_bytes, a, tp))

    # LM head on the sampled rows only. Its weight is read only if some row is sampled.
    if head_bytes is None:
        head_bytes = embed_bytes if config.tie_word_embeddings else weight_bytes
    w = h * vocab * head_bytes if sampled else 0.0
    ops.append(OpCost("lm_head", MATMUL, 2 * sampled * h * vocab,
                      w + sampled * h * a + sampled * vocab * a, weight_bytes=w, rows=sampled))

    # Sampling over the full (gathered) vocabulary: a fused kernel reads the logits once.
    ops.append(OpCost("sampling", VECTOR, _SAMPLING_FLOPS * sampled * config.vocab_size,
                      sampled * config.vocab_size * a))

    comm_bytes = 0.0
    if tp > 1:
        # Ring all-reduce sends 2(N-1)/N of the message per GPU: two per layer
        # (after o_proj and down_proj) and one for the vocab-parallel embedding;
        # the logits are all-gathered, (N-1)/N of them per GPU.
        # At batch 1 the messages are 8 kB: their fixed cost, not the link, is the time.
        ring = 2 * (tp - 1) / tp
        comm_bytes = (2 * layers + 1) * ring * tokens * h * a
        comm_bytes += (tp - 1) / tp * sampled * config.vocab_size * a
        messages = 2 * layers + 1 + (1 if sampled else 0)
        ops.append(OpCost("tp all-reduce", COMM, 0.0, comm_bytes,
                          latency_s=messages * allreduce_latency_s))

    hbm_ops = [op for op in ops if op.kind != COMM]
    return StepCost(
        ops=tuple(ops), num_tokens=tokens, num_sampled=sampled, compute_dtype=compute_dtype,
        flops=sum(op.flops for op in ops),
        bytes=sum(op.bytes for op in hbm_ops),
        comm_bytes=comm_bytes)


def expected_active_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a layer's routing touches for `tokens` tokens, top_k each, uniformly
    routed: E (1 - (1 - k/E)^T). Batch 1 reads k experts' weights; at large T, all E."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _moe_ops(config: ModelConfig, moe_layers: int, tokens: int, weight_bytes: float, a: float,
             tp: int) -> list[OpCost]:
    """An MoE model's sparse layers: the router, the experts (rooflm/kernels/fused_moe.py: the
    weights of only the experts the batch touches are read; gate_up with SiLU-mul fused, then
    down with the routing weights), and a shared expert where the family has one. Experts
    shard their intermediate dimension over TP like the dense MLP."""
    h, experts, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    inter = config.expert_intermediate_size // tp
    pairs = tokens * k
    active = expected_active_experts(tokens, experts, k)
    router_w = experts * h * weight_bytes
    ops = [OpCost("moe router", MATMUL, moe_layers * 2 * tokens * h * experts,
                  moe_layers * (router_w + tokens * h * a + tokens * experts * 4), weight_bytes=moe_layers * router_w)]
    w = active * 3 * h * inter * weight_bytes
    acts = pairs * (h + 2 * inter + 2 * h) * a + tokens * h * a
    ops.append(OpCost("moe experts", MATMUL, moe_layers * 6 * pairs * h * inter, moe_layers * (w + acts),
                      weight_bytes=moe_layers * w))
    shared = config.shared_expert_intermediate_size // tp
    if shared:
        w = (3 * h * shared + h) * weight_bytes
        ops.append(OpCost("shared expert", MATMUL, moe_layers * 2 * tokens * h * (3 * shared + 1),
                          moe_layers * (w + tokens * (2 * h + 3 * shared) * a), weight_bytes=moe_layers * w))
    return ops


# GGUF block formats: what rooflm's CPU kernels multiply directly (rooflm/quant/native.py).
GGUF_BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k")


@dataclass(frozen=True)
class Precision:
    """The precision a step really runs in on one kind of device."""

    weight_dtype: str  # a WEIGHT_FORMATS key: the bytes each weight costs
    compute_dtype: str  # the roof the linear layers run under
    act_bytes: float  # bytes per activation element between kernels
    note: str


def engine_precision(weight_dtype: str, on_cpu: bool = False) -> Precision:
    """What the engine runs a `weight_dtype` model in. On a GPU: the format's own compute dtype,
    bf16 activations (fp32 for an fp32 model). On a CPU the engine's dtype is fp32 (auto), and
    GGUF blocks go to the native kernels, which quantize the activations to int8 per block of 32
    and multiply with integer SIMD instructions."""
    if weight_dtype not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; known: {', '.join(WEIGHT_FORMATS)}")
    fmt = WEIGHT_FORMATS[weight_dtype]
    if not on_cpu:
        return Precision(weight_dtype, fmt.compute_dtype, 4.0 if weight_dtype == "fp32" else 2.0, fmt.note)
    if weight_dtype in GGUF_BLOCK_FORMATS:
        bits = 8 * fmt.bytes_per_param
        return Precision(weight_dtype, "int8", 4.0,
                         f"GGUF {weight_dtype.upper()} blocks, {bits:g} bits a weight with their scales, int8 "
                         f"activations in the native block kernels, fp32 between them")
    if weight_dtype in ("bf16", "fp16"):
        return Precision(weight_dtype, "bf16", 2.0, f"{weight_dtype} weights and activations on the CPU")
    if weight_dtype == "fp32":
        return Precision(weight_dtype, "fp32", 4.0, "fp32 weights and activations (the CPU's default dtype)")
    return Precision(weight_dtype, "bf16", 4.0,
                     f"{fmt.note.split(',')[0]}, bf16 matmuls on the CPU, fp32 activations")


def phase_step_cost(config: ModelConfig, phase: str, batch_size: int, context: int,
                    weight_dtype: str = "bf16", kv_dtype: str = "bf16", tp: int = 1,
                    allreduce_latency_s: Optional[float] = None,
                    precision: Optional[Precision] = None,
                    head_bytes: Optional[float] = None) -> StepCost:
    """The step of a uniform batch: `batch_size` sequences of `context` tokens.

    decode: every sequence decodes one token with `context` positions to attend
    (cache plus the new token). prefill: every sequence computes its whole
    `context`-token prompt from scratch and samples its first output token.
    precision: what the step runs in (engine_precision); default: `weight_dtype` on a GPU.
    head_bytes: bytes per embedding / tied LM head weight as the engine keeps them (a GGUF
    file's Q8_0 table on a CPU), default step_cost's.
    """
    if kv_dtype not in KV_CACHE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {', '.join(KV_CACHE_BYTES)}")
    if batch_size < 1 or context < 1:
        raise ValueError("batch size and context must be >= 1")
    precision = precision or engine_precision(weight_dtype)
    fmt = WEIGHT_FORMATS[precision.weight_dtype]
    tied = head_bytes is not None and config.tie_word_embeddings
    common = dict(weight_bytes=fmt.bytes_per_param, kv_bytes=KV_CACHE_BYTES[kv_dtype],
                  act_bytes=precision.act_bytes, tp=tp, compute_dtype=precision.compute_dtype,
                  allreduce_latency_s=allreduce_latency_s,
                  embed_bytes=head_bytes if tied else None, head_bytes=head_bytes)
    window = config.sliding_window
    attended = min(context, window) if window else context
    if phase == "decode":
        return step_cost(config, num_decode_seqs=batch_size,
                         decode_context_tokens=batch_size * attended, **common)
    if phase == "prefill":
        return step_cost(config, prefill_tokens=batch_size * context,
                         prefill_attention_pairs=batch_size * causal_pairs(context, 0, window),
                         prefill_context_tokens=batch_size * context,
                         num_sampled_prefills=batch_size, **common)
    raise ValueError(f"phase must be prefill or decode, got {phase!r}")


@dataclass(frozen=True)
class OpRoofline:
    """One operation placed on one GPU's roofline."""

    op: OpCost
    peak_flops: float  # FLOP/s of the roof this op's arithmetic runs under (0 for COMM)
    bandwidth: float  # bytes/s of the roof its traffic runs under (HBM, or the link for COMM)
    compute_s: float
    memory_s: float

    @property
    def floor_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        if self.op.kind == COMM:
            return "link"
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def ridge_point(self) -> float:
        return self.peak_flops / self.bandwidth if self.bandwidth else math.inf


def matmul_roof(gpu: GpuSpec, compute_dtype: str, rows: int = 0) -> str:
    """The roof a weight matmul of `rows` tokens runs under: its compute dtype's, except a CPU's
    native int8 block kernels meeting fewer tokens a row than their tile (a batch-1 decode), which
    unpack every weight block for each token and run at their measured one-token rate (perf/gpus.py)."""
    if gpu.is_cpu and compute_dtype == "int8" and 0 < rows < BLOCK_DOT_TILE and INT8_ONE_TOKEN in gpu.peak_tflops:
        return INT8_ONE_TOKEN
    return compute_dtype


def layer_roof(step: "StepCost", gpu: GpuSpec) -> str:
    """The roof the step's layer matmuls run under (matmul_roof at the step's tokens)."""
    return matmul_roof(gpu, step.compute_dtype, step.num_tokens)


def op_roofline(op: OpCost, gpu: GpuSpec, compute_dtype: str = "bf16") -> OpRoofline:
    """Place one operation under the roof that applies to its kind of work."""
    if op.kind == COMM:
        if gpu.interconnect_gbs is None:
            raise ValueError(f"{gpu.name} has no GPU-to-GPU link in the table; tp must be 1")
        link = gpu.interconnect_gbs * 1e9
        return OpRoofline(op, 0.0, link, 0.0, op.bytes / link + op.latency_s)
    if op.kind == MATMUL:
        peak = gpu.peak_flops(matmul_roof(gpu, compute_dtype, op.rows))
    elif op.kind == ATTENTION:
        # Attention multiplies activations, not weights: bf16 for every weight format but a
        # float32 model's (whose attention in bf16 would be priced at a CPU's scalar bf16 rate),
        # and a CPU's GGUF model's, whose activations are fp32 between the int8 block kernels.
        fp32 = compute_dtype == "fp32" or (gpu.is_cpu and compute_dtype == "int8")
        peak = gpu.peak_flops("fp32" if fp32 else "bf16")
    else:
        peak = gpu.peak_flops("fp32")
    return OpRoofline(op, peak, gpu.mem_bw, op.flops / peak, op.bytes / gpu.mem_bw)


def roofline(step: StepCost, gpu: GpuSpec) -> list[OpRoofline]:
    """Every operation of a step on `gpu`'s roofline, in step order."""
    return [op_roofline(op, gpu, step.compute_dtype) for op in step.ops]


@dataclass(frozen=True)
class StepSummary:
    """The figures a verdict is made of."""

    floor_s: float
    memory_bound_s: float  # part of the floor spent in memory-bound ops
    compute_bound_s: float
    link_s: float
    weight_bytes: float
    kv_bytes: float
    other_bytes: float
    matmul_intensity: float  # FLOP/B of the linear layers, weights included
    matmul_ridge: float  # ridge point of the linear layers' roof
    tokens_per_s: float  # tokens through the model per second at the floor
    sampled_per_s: float  # sampled tokens per second at the floor


def summarize(step: StepCost, gpu: GpuSpec) -> StepSummary:
    rows = roofline(step, gpu)
    floor = sum(r.floor_s for r in rows)
    matmul_flops = sum(r.op.flops for r in rows if r.op.kind == MATMUL)
    matmul_bytes = sum(r.op.bytes for r in rows if r.op.kind == MATMUL)
    weight = sum(r.op.weight_bytes for r in rows)
    kv = sum(r.op.kv_bytes for r in rows)
    return StepSummary(
        floor_s=floor,
        memory_bound_s=sum(r.floor_s for r in rows if r.bound == "memory"),
        compute_bound_s=sum(r.floor_s for r in rows if r.bound == "compute"),
        link_s=sum(r.floor_s for r in rows if r.bound == "link"),
        weight_bytes=weight, kv_bytes=kv, other_bytes=step.bytes - weight - kv,
        matmul_intensity=matmul_flops / matmul_bytes if matmul_bytes else 0.0,
        matmul_ridge=gpu.ridge_point(layer_roof(step, gpu)),
        tokens_per_s=step.num_tokens / floor if floor else 0.0,
        sampled_per_s=step.num_sampled / floor if floor else 0.0,
    )


def verdict(step: StepCost, gpu: GpuSpec, phase: str, weight_bytes_per_param: float) -> str:
    """One plain-language paragraph: what bounds this step, why, and what its ceiling is."""
    s = summarize(step, gpu)
    gb = 1e9
    # The batch at which the weight matmuls reach the ridge: intensity of a
    # [T, K] x [K, N] matmul is about 2*T / bytes-per-weight when the weights dominate.
    ridge_tokens = s.matmul_ridge * weight_bytes_per_param / 2
    bound = "memory-bound" if s.memory_bound_s >= s.compute_bound_s else "compute-bound"
    tokens = step.num_tokens
    units = "SIMD units" if gpu.is_cpu else "tensor cores"
    bandwidth = (f"{gpu.mem_bw_gbs:.1f} GB/s" if gpu.mem_bw_gbs < 1000 else f"{gpu.mem_bw_gbs / 1e3:.2f} TB/s")
    lines = []
    if bound == "memory-bound":
        lines.append(
            f"Each step reads every weight once ({s.weight_bytes / gb:.2f} GB) and the KV cache "
            f"({s.kv_bytes / gb:.2f} GB) to produce {tokens} token{'s' if tokens != 1 else ''}: "
            f"the linear layers do 2 FLOPs per parameter per token, which at "
            f"{weight_bytes_per_param:g} byte{'s' if weight_bytes_per_param != 1 else ''} per "
            f"parameter is {s.matmul_intensity:.1f} FLOP/B against a ridge of {s.matmul_ridge:.0f} FLOP/B, "
            f"so the {units} wait on {gpu.memory_name}: {bound} "
            f"({100 * s.memory_bound_s / s.floor_s:.0f}% of the floor is in memory-bound ops). "
            f"The ceiling is bandwidth / bytes per step = {bandwidth} / "
            f"{step.bytes / gb:.2f} GB = {s.floor_s * 1e3:.2f} ms per step, at most "
            f"{s.tokens_per_s:,.0f} tokens/s.")
        attention = [op for op in step.ops if op.kind == ATTENTION]
        if phase == "decode" and s.kv_bytes > s.weight_bytes and attention:
            lines.append(
                f"The KV cache now outweighs the weights: each sequence brings its own K and V to "
                f"read, so attention stays at {attention[0].intensity:.0f} FLOP/B (query heads per "
                f"KV head) whatever the batch, and batching no longer amortizes it; a shorter "
                f"context or a smaller KV dtype (fp8 halves it) is what moves this ceiling.")
        elif phase == "decode" and tokens < ridge_tokens:
            lines.append(
                f"Batching is the lever: the weight matmuls stay memory-bound up to about "
                f"{ridge_tokens:.0f} tokens per step (ridge x {weight_bytes_per_param:g} bytes per "
                f"weight / 2 FLOPs), so more sequences per step share the same weight read and "
                f"raise tokens/s almost for free, until the KV cache reads, which grow with every "
                f"sequence and its context, take over.")
    else:
        lines.append(
            f"Each step pushes {tokens:,} tokens through every weight: the linear layers reach "
            f"{s.matmul_intensity:.0f} FLOP/B, above the ridge of {s.matmul_ridge:.0f} FLOP/B, "
            f"so memory keeps up and the {units} are the limit: {bound} "
            f"({100 * s.compute_bound_s / s.floor_s:.0f}% of the floor is in compute-bound ops). "
            f"The ceiling is peak FLOP/s / FLOPs per step = "
            f"{_flops_text(gpu.peak_flops(layer_roof(step, gpu)))} / "
            f"{step.flops / 1e12:.4g} TFLOP = {s.floor_s * 1e3:.2f} ms per step, at most "
            f"{s.tokens_per_s:,.0f} tokens/s.")
    if s.link_s > 0.1 * s.floor_s:
        lines.append(f"Tensor-parallel all-reduces take {100 * s.link_s / s.floor_s:.0f}% of the floor.")
    return " ".join(lines)


def _flops_text(flops: float) -> str:
    """A FLOP/s rate in the unit that reads well: TFLOP/s for a GPU, GFLOP/s for a CPU."""
    return f"{flops / 1e12:,.0f} TFLOP/s" if flops >= 1e13 else f"{flops / 1e9:,.1f} GFLOP/s"
