"""Frozen configuration, one dataclass per layer of the system.

Derived runtime values (the number of KV blocks that fit, the dtype chosen
for a device) live in the objects that compute them, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


ROPE_SCALING_TYPES = ("llama3", "linear", "longrope", "yarn")

# Where tensor/pipeline-parallel workers and data-parallel replicas run: "mp" processes of this
# host (multiprocessing spawn), "ray" actors on the nodes of a Ray cluster.
PLACEMENT_BACKENDS = ("mp", "ray")


def require_placement_backend(backend: str, name: str) -> None:
    """Refuse, at once, a backend that is unknown or whose package is not installed (ValueError
    naming the field `name`)."""
    if backend not in PLACEMENT_BACKENDS:
        raise ValueError(f"{name} must be one of {', '.join(PLACEMENT_BACKENDS)}; got {backend!r}")
    if backend == "ray":
        import importlib.util
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"{name} 'ray' needs Ray, which is not installed: it is an optional "
                             f"extra, pip install 'rooflm[ray]'")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, by HF's rope_type:

    - "llama3" (Llama 3.1): long wavelengths slowed by `factor`, a smooth band between
      low_freq_factor and high_freq_factor;
    - "linear" (Gemma 3's global layers): every frequency divided by `factor`;
    - "longrope" (Phi-3, Phi-4-mini): per-frequency divisors, short_factor for positions below
      original_max_position_embeddings and long_factor from there on, and cos/sin scaled by
      attention_factor (None: sqrt(1 + ln(factor) / ln(original)), as HF computes it);
    - "yarn" (gpt-oss): frequencies interpolated by `factor` below a band of rotations
      [beta_slow, beta_fast] over original_max_position_embeddings and kept above it, with a linear
      ramp between (floored/ceiled where truncate), and cos/sin scaled by attention_factor (None:
      0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio where both are given): HF's
      _compute_yarn_parameters.
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: Optional[float] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported; rooflm runs "
                             f"{', '.join(ROPE_SCALING_TYPES)}")
        # JSON (config.json, the simulator's calibration files) gives lists: kept hashable.
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError(f"longrope scaling needs short_factor and long_factor of one length, got "
                             f"{len(self.short_factor)} and {len(self.long_factor)}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer of the Llama family.

    Covers Llama 2/3/3.1, Mistral, SmolLM2, Qwen2/2.5 (qkv bias) and Qwen3
    (q/k RMSNorm), and the fields the other families add (model/registry.py), each with a
    default that leaves a Llama unchanged. Field names follow HF transformers' config.json.
    """

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2/2.5: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    sliding_window: Optional[int] = None  # Mistral v0.1; the window of "sliding_attention" layers
    # Per-layer attention kind, HF's layer_types ("sliding_attention" | "full_attention"); empty:
    # every layer uses sliding_window (Gemma 2 alternates them).
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh (Gemma)
    query_pre_attn_scalar: Optional[float] = None  # attention scale 1/sqrt(this); None: head_dim
    attn_logit_softcapping: Optional[float] = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: Optional[float] = None  # Gemma 2: the same on the logits
    # The rotated fraction of each head (Phi-4-mini: 0.75, its first 96 of 128 dims); the rest passes.
    partial_rotary_factor: float = 1.0
    # Gemma 3: the RoPE base of its sliding-window layers (rope_local_base_freq); rope_theta and
    # rope_scaling are then the global layers'. None: one base for every layer.
    rope_local_theta: Optional[float] = None
    # SmolLM3: 1 where a layer applies RoPE, 0 where it does not (HF's no_rope_layers); empty: all do.
    no_rope_layers: tuple[int, ...] = ()
    # Granite: the embedding times embedding_multiplier, each sublayer's output times
    # residual_multiplier before its residual add, attention_multiplier the score scale (None:
    # query_pre_attn_scalar's or head_dim's), the logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    logits_scaling: float = 1.0
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE; HF's names). num_experts 0: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; 0: intermediate_size (Mixtral, OLMoE)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    # HF's rule for which layers are sparse: layer i is, unless i is in mlp_only_layers, when
    # (i + 1) % decoder_sparse_step == 0; the others keep a dense MLP of intermediate_size.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # gpt-oss: a bias on o_proj too (its attention_bias covers all four projections), one learned
    # sink logit per query head in the softmax's denominator, biases on the router and on every
    # expert's projections, and the experts' clamped SwiGLU (model/gpt_oss.py).
    o_proj_bias: bool = False
    attention_sinks: bool = False
    moe_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.num_experts and self.decoder_sparse_step < 1:
            raise ValueError(f"ModelConfig.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts (HF's Qwen-MoE rule; every layer when
        decoder_sparse_step is 1 and mlp_only_layers empty, as in Mixtral and OLMoE)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def moe_layer_params(self, experts: int) -> int:
        """One MoE layer's MLP parameters with `experts` routed experts counted: the router, those
        experts' gate/up/down, and the shared expert with its gate."""
        h = self.hidden_size
        shared = 3 * h * self.shared_expert_intermediate_size
        if shared:
            shared += h
        router = self.num_experts * (h + 1) if self.moe_bias else self.num_experts * h
        return router + experts * self.expert_params + shared

    @property
    def expert_params(self) -> int:
        """One routed expert's gate, up and down (and their biases: gpt-oss)."""
        h, i = self.hidden_size, self.expert_intermediate_size
        return 3 * h * i + (2 * i + h if self.moe_bias else 0)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding and head counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.o_proj_bias:
            attn += h
        if self.attention_sinks:
            attn += self.num_attention_heads
        per_layer = attn + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        moe_layers = self.num_moe_layers
        mlps = (self.num_hidden_layers - moe_layers) * 3 * h * i + moe_layers * self.moe_layer_params(self.num_experts)
        return v * h + self.num_hidden_layers * per_layer + mlps + h + head

    def num_active_params(self) -> int:
        """Parameters one token computes with: num_params with only num_experts_per_tok of each
        MoE layer's experts (the router and shared expert in full); num_params for a dense model."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params() - self.num_moe_layers * self.expert_params * idle

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights and tokenizer come from.

    model: an HF directory, a .gguf file, a Hugging Face Hub repo id (owner/name, or
    owner/name:file.gguf; downloaded, rooflm/model/hub.py), or a preset name (with load_format
    "dummy"). None means the embedded default model (SmolLM2-135M-Instruct).
    revision, download_dir: a Hub model's branch, tag or commit, and the Hub cache it is
    downloaded into (None: huggingface_hub's, under HF_HOME); local paths ignore both.
    """

    model: Optional[str] = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    tokenizer: Optional[str] = None
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    seed: int = 0
    # auto: GGUF Q4_0/Q4_1/Q8_0/Q4_K weights stay in their blocks where a kernel multiplies them
    # and that path has passed its tests on the device: the CPU block matmuls (rooflm/quant/).
    # gguf: also on one CUDA device, through the W4A16/W8A16 kernels (exact repacks of the blocks;
    # not yet run on a GPU, so auto still dequantizes GGUF there).
    # none: every weight dequantized to --dtype (exact float weights, slower).
    # GPTQ/AWQ checkpoints (config.json quantization_config) stay quantized on CUDA under auto.
    # int8 | int4-g32 | int4-g64 | int4-g128: round-to-nearest weight-only quantization of the
    # decoder's linear layers and an untied LM head at load (rooflm/quant/rtn.py), e.g. for
    # dummy-weight speed runs.
    # fp8: FP8 W8A8 at load, per-channel E4M3 weights and dynamic per-token activations
    # (rooflm/quant/fp8.py; torch._scaled_mm on sm89+, the same numerics in fp32 elsewhere).
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be one of auto, safetensors, gguf, dummy; got {self.load_format!r}")
        if self.quantization not in ("auto", "none", "gguf", "int8", "int4-g32", "int4-g64", "int4-g128", "fp8"):
            raise ValueError(f"quantization must be auto, none, gguf, int8, int4-g32, int4-g64, int4-g128 or "
                             f"fp8; got {self.quantization!r}")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")


# KV block sizes in tokens when none is given (CacheConfig.block_size None), by device type.
CUDA_BLOCK_SIZE = 64
CPU_BLOCK_SIZE = 16


# --kv-offload-gb unset on CUDA: this share of the host's available memory at start-up, at
# most KV_OFFLOAD_AUTO_MAX_GB per GPU (model_runner.num_offload_blocks). Pinned memory is
# taken from the OS for good and pinning costs start-up time (~1 s per few GiB), and every
# GPU process of the host pins its own: so the share stays modest.
KV_OFFLOAD_AUTO_SHARE = 0.1
KV_OFFLOAD_AUTO_MAX_GB = 16.0


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    The pool is num_blocks fixed-size blocks. On CUDA, when num_blocks is None,
    it is sized from free memory after a profiling pass (gpu_memory_utilization).
    On CPU, cpu_kv_cache_gb bounds it.
    """

    # None: 64 on CUDA (128 where prefill runs through FlashAttention-4, RuntimeConfig.prefill_attention),
    # 16 on the CPU. 64 lets the prefill kernel load whole key tiles through
    # TMA (a 64-key tile inside one block): on the H100, causal prefill 299 -> 427 TFLOP/s at
    # S = 2048 and a 16k prompt's TTFT 566 -> 502 ms, with decode, ShareGPT-like throughput and
    # memory unchanged (benchmarks/results/attention-hopper-h100-20261126/). The price: prefix
    # hits count whole blocks, so up to 63 tokens of a shared prefix are recomputed, not 15.
    block_size: Optional[int] = None
    num_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0
    swap_space_gb: float = 1.0  # host memory for swap preemption
    enable_prefix_caching: bool = True
    # The prefix cache's host-memory tier (engine/host_kv_tier.py), in GiB: evicted cached blocks
    # are copied there and copied back on a hit instead of recomputed. vLLM's flag name. None:
    # 0 on the CPU (its pool is host memory already); on CUDA 10% of the host's available
    # memory at start-up, at most 16 GiB per GPU (model_runner.num_offload_blocks).
    kv_offload_gb: Optional[float] = None
    # auto: K/V stored in the model's dtype. fp8 (or fp8_e4m3): E4M3 with one fp32 scale per
    # token and KV head (layers/kv_cache.py): half the bytes per decode step, twice the tokens.
    kv_cache_dtype: str = "auto"
    # FP8 caches' scales (layers/kv_cache.py). auto: the checkpoint's static per-tensor K/V scales
    # where it has them (compressed-tensors kv_cache_scheme), else one per token and KV head.
    # per-token: always per token. static: the checkpoint's, else 1.0 (vLLM's default); no
    # per-key scale work in the attention kernels.
    kv_cache_scales: str = "auto"
    # Off: sliding-window layers (Gemma 2/3, gpt-oss) keep their whole history in the one block
    # table every layer shares. On (default): they are KV cache groups of their own that hold
    # only their window (engine/kv_groups.py). vLLM's flag name.
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.kv_cache_scales not in ("auto", "per-token", "static"):
            raise ValueError(f"kv_cache_scales must be auto, per-token or static, got {self.kv_cache_scales!r}")
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_offload_gb is not None and self.kv_offload_gb < 0:
            raise ValueError(f"kv_offload_gb must be >= 0, got {self.kv_offload_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    # None: 1024 on CUDA devices of 70 GB or more (ShareGPT-like traffic on an H100: +5.9% over
    # 512, which was +25% over 256; benchmarks/results/traffic-*; vLLM's default on such GPUs
    # too), 512 on smaller CUDA devices, 256 on the CPU.
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # recompute | swap
    # Admission keeps KV room for the running requests' expected growth (growth_reserve.py).
    reserve_new_tokens: bool = True
    # vLLM's names: fcfs, or priority (a request's priority, lower first, ties by arrival; a
    # waiting request may preempt running ones of lower priority when the KV pool is full).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")


PREFILL_ATTENTION_CHOICES = ("auto", "triton", "fa4")


@dataclass(frozen=True)
class RuntimeConfig:
    """GPU runtime switches (issue: CUDA graphs, overlap)."""

    enforce_eager: bool = False
    # Schedule and queue step t+1 before reading step t's tokens back, so the host's work
    # (scheduling, inputs, output processing) overlaps the device's; outputs arrive one step
    # later. None = on with CUDA (H100, Llama-3-8B: batch-1 step 5.7-6.1 -> 5.5 ms, batch-64
    # 8.4-9.6 -> 7.6 ms; benchmarks/results/engine-h100-20261121-s2), off on the CPU.
    async_scheduling: Optional[bool] = None
    cuda_graph_max_batch: Optional[int] = None  # None: max_num_seqs
    # Steps with prefill chunks (mixed prefill + decode, prefill) replay one CUDA graph per
    # layer with attention run eagerly between them (engine/piecewise_graph.py), for up to
    # max_num_batched_tokens tokens: eager launches cost more host time than the GPU's work.
    piecewise_cuda_graphs: bool = True
    # One-token steps (batch-1 decode) run each layer as four Triton GEMVs with the norms,
    # SiLU-mul and residual adds fused in (rooflm/kernels/gemv.py); False: cuBLAS + separate kernels.
    decode_gemv: bool = True
    attention_backend: str = "auto"  # auto (triton on CUDA, torch reference on CPU) | triton | reference
    # Prefill chunks under the triton backend: auto (FlashAttention-4's SM90 kernel on compute
    # capability 9.x when the flash-attn-4 package is installed, else the Triton kernel) | triton | fa4
    # (kernels/fa4_prefill.py). With FA4 the CUDA default block size is 128 (one TMA load a tile).
    prefill_attention: str = "auto"
    # Freeze the start-up heap and collect young objects every 50,000 allocations instead of 700
    # (process-wide; engine/host_gc.py): the collector took about half the host time per sequence.
    tune_gc: bool = True
    # Batch-invariant kernels (rooflm/deterministic/): a request's tokens and logprobs do not depend
    # on what else is in the batch, the step's size, chunking, preemption, prefix hits or graphs.
    # Costs speed (docs/deterministic.md); turns decode_gemv off.
    deterministic: bool = False
    # vLLM's sleep mode: the engine may free its KV pool and move (level 1) or drop (level 2)
    # its weights while idle (LLMEngine.sleep / wake_up; the server's /sleep and /wake_up).
    enable_sleep_mode: bool = False
    # Count the tokens routed to each expert, per MoE layer and step, on the device (inside the
    # CUDA graphs: decided before they are captured); `rooflm profile` turns it on.
    count_expert_load: bool = False

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "triton", "reference"):
            raise ValueError(f"attention_backend must be auto, triton or reference; got {self.attention_backend!r}")
        if self.prefill_attention not in PREFILL_ATTENTION_CHOICES:
            raise ValueError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION_CHOICES)}; "
                             f"got {self.prefill_attention!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (rooflm/spec/): a proposer drafts up to k tokens per sequence and
    the target model verifies them in one forward; outputs are those of plain decoding."""

    speculative_method: Optional[str] = None  # None (off) | ngram | draft
    num_speculative_tokens: int = 4  # k: draft tokens per sequence and step, at most
    draft_model: Optional[str] = None  # --speculative-method draft: path, .gguf or preset name
    draft_load_format: str = "auto"  # auto | safetensors | gguf | dummy
    # Prompt lookup: the longest suffix of the sequence (max down to min tokens) that occurred
    # earlier in it proposes the tokens that followed that occurrence.
    ngram_prompt_lookup_max: int = 4
    ngram_prompt_lookup_min: int = 1
    # Speculate only while the step's decode rows times (1 + k) stay within this many tokens,
    # shortening k (then switching speculation off) as the batch grows: past it the verify
    # forward is no longer memory-bound and its extra rows cost the batch real compute.
    # None: 256 on CUDA (the bf16 GEMM's ridge point on an H100 is ~300 tokens), 8 on the CPU.
    speculative_max_batch_tokens: Optional[int] = None
    # adaptive: within that budget, speculate at a batch size only while speculating steps have
    # measured more tokens per second than plain ones there (rooflm/spec/policy.py); budget:
    # always speculate within it.
    speculative_policy: str = "adaptive"
    # Verify greedy sequences in a loop kept on the device (rooflm/spec/loop.py): the next step
    # is queued before the host reads the last one's tokens. None: where CUDA graphs run it;
    # True: also eagerly (the CPU); False: never (every verify step goes through the host).
    speculative_device_loop: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.speculative_policy not in ("adaptive", "budget"):
            raise ValueError(f"speculative_policy must be adaptive or budget, got {self.speculative_policy!r}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be ngram or draft, got {self.speculative_method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method draft needs draft_model (a path, .gguf or preset name)")
        if self.draft_load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"draft_load_format must be one of auto, safetensors, gguf, dummy; "
                             f"got {self.draft_load_format!r}")
        if not 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max:
            raise ValueError(f"need 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, got "
                             f"{self.ngram_prompt_lookup_min} and {self.ngram_prompt_lookup_max}")
        if self.speculative_max_batch_tokens is not None and self.speculative_max_batch_tokens < 2:
            raise ValueError(f"speculative_max_batch_tokens must be >= 2, got "
                             f"{self.speculative_max_batch_tokens}")


@dataclass(frozen=True)
class ParallelConfig:
    """Spreading one model over several devices (rooflm/distributed/)."""

    # One worker process per rank (rank 0 is the engine's own process); each holds 1/N of
    # the heads, the MLP columns and the vocabulary, and its own KV pool.
    tensor_parallel_size: int = 1
    # How the row-parallel layers' all-reduces run on CUDA (rooflm/distributed/allreduce.py):
    # "symm" a one-shot kernel over symmetric (CUDA IPC) memory for messages up to 4 MiB, NCCL
    # above; "nccl" always NCCL; "auto" symm where every GPU pair has peer access, else NCCL.
    # The CPU (gloo) ignores it.
    tp_allreduce: str = "auto"
    # Mixture-of-experts layers split their experts across the tensor-parallel ranks (each rank
    # holds E / N whole experts) instead of sharding every expert's intermediate dimension;
    # attention stays tensor-parallel (layers/moe.py, docs/moe.md). vLLM's --enable-expert-parallel.
    enable_expert_parallel: bool = False
    # Pipeline parallelism (rooflm/distributed/pipeline.py): the layers split into this many
    # stages, one TP group of tensor_parallel_size ranks each; stage 0 also holds the embedding,
    # the LM head and the sampler, the last stage the final norm.
    pipeline_parallel_size: int = 1
    # Batches in flight through the pipeline at once (vLLM's virtual engines): the scheduler hands
    # out up to this many, each of requests the others do not hold, before the first returns, so
    # the stages work on different batches at once. None: pipeline_parallel_size; 1: one step at
    # a time through every stage (each GPU idles (PP - 1) / PP of it).
    pipeline_micro_batches: Optional[int] = None
    # How ranks 1..N-1 start: "mp" processes of this host; "ray" actors in one placement group of
    # a Ray cluster (the nodes may be other hosts: rooflm/distributed/ray_process.py).
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        require_placement_backend(self.distributed_executor_backend, "distributed_executor_backend")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise ValueError(f"pipeline_micro_batches must be >= 1, got {self.pipeline_micro_batches}")
        if self.tp_allreduce not in ("auto", "nccl", "symm"):
            raise ValueError(f"tp_allreduce must be one of auto, nccl, symm; got {self.tp_allreduce!r}")

    @property
    def batches_in_flight(self) -> int:
        """Batches the engine keeps in flight: 1 without pipeline parallelism."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (rooflm/lora/, docs/lora.md): vLLM's flags and defaults."""

    enable_lora: bool = False
    # Adapters resident on the device at once: the slot pool's size, so the most distinct
    # adapters one step may use.
    max_loras: int = 1
    # The slot pool's rank: an adapter of lower rank is zero-padded to it, a higher one refused.
    max_lora_rank: int = 16
    # Adapters kept loaded in host memory (an LRU cache in front of the disk); None: max_loras.
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def host_cache_size(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


def default_max_num_seqs(device_type: str, device_memory_gb: Optional[float] = None) -> int:
    """SchedulerConfig.max_num_seqs when none is set: more sequences where the pool can hold them."""
    if device_type != "cuda":
        return 256
    return 1024 if device_memory_gb is not None and device_memory_gb >= LARGE_GPU_GB else 512


LARGE_GPU_GB = 70.0  # H100 / H200 class (an 80 GB H100 reports ~79.2 GiB, 85 GB)


def resolve_max_num_seqs(max_num_seqs: Optional[int], device_type: str,
                         device_memory_gb: Optional[float] = None) -> int:
    """The sequence cap a replica runs with: the one set, else the device's default. The engine
    (with_device_defaults), `rooflm simulate` and `rooflm memory` all take it from here, so a
    plan or a simulation of a GPU uses the cap the engine would pick on it."""
    if max_num_seqs is not None:
        return max_num_seqs
    return default_max_num_seqs(device_type, device_memory_gb)


def kv_blocks_cap(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most KV blocks a pool can use: every sequence at full length. Past it, blocks only
    keep cached prefixes (and a small model on a large GPU would build millions of them)."""
    return max_num_seqs * -(-max_model_len // block_size)


def step_activation_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                          act_bytes: float, tp: int = 1) -> float:
    """The widest live set of one step at the scheduler's budgets: inside the MLP, the residual
    and its norm output (2h), gate/up (2I) and SiLU-mul (I) for every batched token, the MLP split
    over tp ranks, plus fp32 logits of the sampled rows. The engine checks a load against it
    before allocating (on CUDA its profiling pass then measures the real figure); `rooflm memory`
    and the simulator reserve it."""
    per_token = (2 * config.hidden_size + 3 * (config.intermediate_size // tp)) * act_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * config.vocab_size * 4


def with_device_defaults(cfg: EngineConfig, device_type: str, cuda_block_size: int = CUDA_BLOCK_SIZE,
                         device_memory_gb: Optional[float] = None) -> EngineConfig:
    """The config with the defaults that depend on the device filled in (None fields).
    cuda_block_size: the block size a CUDA device gets when none is set (128 where prefill
    runs through FlashAttention-4: kernels/fa4_prefill.py). device_memory_gb: the CUDA device's
    memory (1e9 bytes), which sets the default sequence cap."""
    from dataclasses import replace

    sched, runtime, spec, cache = cfg.scheduler, cfg.runtime, cfg.speculative, cfg.cache
    if cache.block_size is None:
        cache = replace(cache, block_size=cuda_block_size if device_type == "cuda" else CPU_BLOCK_SIZE)
    if cache.kv_offload_gb is None and device_type != "cuda":
        cache = replace(cache, kv_offload_gb=0.0)  # CUDA's share of host memory is read at start-up
    if sched.max_num_seqs is None:
        sched = replace(sched, max_num_seqs=resolve_max_num_seqs(None, device_type, device_memory_gb))
    if runtime.cuda_graph_max_batch is None:
        runtime = replace(runtime, cuda_graph_max_batch=sched.max_num_seqs)
    if spec.speculative_method and spec.speculative_max_batch_tokens is None:
        spec = replace(spec, speculative_max_batch_tokens=256 if device_type == "cuda" else 8)
    return replace(cfg, cache=cache, scheduler=sched, runtime=runtime, speculative=spec)


_SECTIONS = {"load": LoadConfig, "device": DeviceConfig, "cache": CacheConfig,
             "scheduler": SchedulerConfig, "runtime": RuntimeConfig, "speculative": SpeculativeConfig,
             "parallel": ParallelConfig, "lora": LoRAConfig}


def engine_config_from_kwargs(**kwargs) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (field names are unique across sections)."""
    from dataclasses import fields

    per_section: dict[str, dict] = {name: {} for name in _SECTIONS}
    for key, value in kwargs.items():
        for section, cls in _SECTIONS.items():
            if key in {f.name for f in fields(cls)}:
                per_section[section][key] = value
                break
        else:
            raise ValueError(f"unknown engine option {key!r}")
    return EngineConfig(**{name: cls(**per_section[name]) for name, cls in _SECTIONS.items()})
