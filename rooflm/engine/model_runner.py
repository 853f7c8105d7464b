"""Turns a SchedulerOutput into tensors, runs the model, and samples.

The only place that knows about devices: it owns the model, the KV cache pool
(and the host pool for swapping), the attention backend, and the sampler.
Inputs are assembled in host lists and copied to the device in one go per
tensor; the sampled token ids are the one device-to-host transfer of a step.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from rooflm import envs
from rooflm.config import (KV_OFFLOAD_AUTO_MAX_GB, KV_OFFLOAD_AUTO_SHARE, EngineConfig, ModelConfig, kv_blocks_cap,
                           step_activation_bytes)
from rooflm.distributed.group import SINGLE, TPGroup
from rooflm.engine.block_manager import slot_mapping, slot_of
from rooflm.engine.block_table_array import BlockTableArray, block_table_array
from rooflm.engine.kv_groups import KVLayout, blocks_per_seq, kv_layout, single_group
from rooflm.engine.report import NULL_TRACER
from rooflm.engine.scheduler import ScheduledSeq, SchedulerOutput
from rooflm.engine.sleep_memory import (ALIGN, WAKE_CHUNK_BYTES, CuMemDriver, Region, WakePhases, adopt_tensors,
                                        host_backup, round_up, stale_addresses, tensor_addresses)
from rooflm.layers.attention import AttentionMetadata, ReferenceBackend
from rooflm.layers import kv_cache as kv_format
from rooflm.layers.kernels import TORCH_KERNELS, Kernels, triton_kernels
from rooflm.layers.kv_cache import KVCache
from rooflm.layers.rejection import verify
from rooflm.layers.sampler import Sampler, SamplingMetadata, SamplingRow, compute_logprobs

logger = logging.getLogger(__name__)

LOGITS_ROW_ALIGN = 64

# Device staging of one batched host copy (apply_block_ops): bounds the temporary a step's
# swaps and host-tier copies take outside the profiled memory, in the headroom the KV budget
# leaves (gpu_memory_utilization), while keeping each copy large (~2.5 ms over PCIe 5).
HOST_COPY_CHUNK_BYTES = 128 * 2**20
# Restores staged ahead on the copy stream (apply_block_ops), per step: their staging lives
# until the step's scatter, so it is bounded apart; the rest of a larger step's restores take
# the in-order path.
RESTORE_AHEAD_BYTES = 2 * HOST_COPY_CHUNK_BYTES

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 is the fast path on GPUs; CPUs here do fp32 matmuls fastest and exactly.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class HostInputs:
    """A step's inputs as host tensors (pinned on CUDA), before the copy to the device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    # KV cache groups 1.. (kv_groups.py): each group's (slot_mapping, block_tables).
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


@dataclass
class StepInputs:
    host: HostInputs
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    num_decodes: int
    order: list[ScheduledSeq]  # the scheduled sequences in batch order (decodes first)
    logits_indices: list[int]  # packed token index whose logits each sampling row uses
    rows: list[SamplingRow]
    row_owner: list[ScheduledSeq]  # which scheduled sequence each sampling row belongs to
    prompt_logprob_spans: list[tuple[ScheduledSeq, int, int, int]]  # (seq, packed index, position, count)
    pending_positions: list[tuple[int, int]]  # (packed index, seq_id) of inputs still on the device
    # Speculative decoding: (first sampling row, number of drafts) of each verifying sequence;
    # its 1 + drafts rows score the drafts and give the token after the accepted ones.
    spec_rows: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StepHandle:
    """A launched step: its inputs, and the device tensors its results will be read from."""

    inputs: StepInputs
    result: StepResult
    sampled: Optional[object] = None  # SamplerOutput, on the device
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> sampling row
    # The sampled ids (and logprobs) on their way to the host: pinned copies queued right
    # after sampling, and an event that fires when they have landed.
    host_sampled: Optional[tuple] = None
    ready: Optional[object] = None  # torch.cuda.Event, None on the CPU
    graph: str = "eager"  # "full": one CUDA graph ran the forward; "piecewise": one per layer
    # Structured outputs: the step's logits and sampling metadata, held until the engine has
    # filled the grammar bitmask (sample_constrained); None once sampled.
    logits: Optional[torch.Tensor] = None
    meta: Optional[SamplingMetadata] = None
    constrained_rows: list[int] = field(default_factory=list)  # rows with a grammar
    num_accepted: Optional[torch.Tensor] = None  # [verifying sequences] accepted drafts (spec)
    spec: object = None  # the proposer's draft distributions (SchedulerOutput.spec)
    # Pipeline parallelism with batches in flight: the step's inputs while its rows are still to
    # come back from the last stage (ModelRunner.complete); None once they have, or without.
    deferred: Optional[StepInputs] = None

    @property
    def needs_bitmask(self) -> bool:
        return self.logits is not None


@dataclass
class StepResult:
    """Host-side results of one step, for the engine's output processing."""

    sampled: dict[int, list[int]]  # seq_id -> sampled token(s): n of them for a forking prompt
    logprobs: dict[int, list[dict]]  # seq_id -> per sampled token: {token_id: (logprob, rank)}
    prompt_logprobs: dict[int, list[Optional[dict]]]  # seq_id -> entries for this chunk


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte pool (FP8 codes) as uint8: the same bytes, and every index op takes it
    (index_copy_ has no Float8 kernel on the CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _runs(host_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(index, first host block, length) of each run of consecutive host blocks in the list
    (in order): one copy each."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_blocks):
        if runs and runs[-1][1] + runs[-1][2] == h:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((i, h, 1))
    return runs


def _to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy in pinned memory, so that waking copies it back at the link's full rate."""
    host = torch.empty_like(t, device="cpu", pin_memory=True)
    host.copy_(t)
    return host


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 tp: TPGroup = SINGLE, stage=None, world: Optional[TPGroup] = None):
        self.config = config
        # Tensor parallelism (rooflm/distributed/): this rank's shard of the model and its own
        # KV pool (its KV heads, the same block tables). Rank 0 sends each step's inputs to
        # the other ranks (step_broadcast.py) and samples; they run the same forward.
        self.tp = tp
        # Pipeline parallelism (distributed/pipeline.py): this rank's stage (its layers, its pool
        # of their KV), None without; world: every rank of every stage (the tp group without PP).
        self.stage = stage
        self.world = world or tp
        # Stage 0 with batches in flight (ParallelConfig.batches_in_flight): a launch runs the
        # stage's layers and sends them on; complete() later takes the rows back and samples.
        self.defers_return = (stage is not None and stage.is_first
                              and config.parallel.batches_in_flight > 1)
        self.num_kv_heads = tp.heads(model_config.num_attention_heads,
                                     model_config.num_key_value_heads).num_kv_heads
        self.step_channel = None
        if self.world.size > 1 and self.world.is_driver:
            from rooflm.distributed.step_broadcast import StepChannel
            self.step_channel = StepChannel(self.world)
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = resolve_device(config.device.device)
        self.dtype = resolve_dtype(config.device.dtype, self.device)
        self.block_size = config.cache.block_size
        self.backend = self._make_backend()
        self.model = None
        # The pools: [layers, 2 (K, V), blocks, block_size, H_kv, D], and for FP8 caches the
        # scales [layers, 2, blocks, block_size, H_kv] fp32 per token, or [layers, 2, H_kv] static
        # (layers/kv_cache.py). Swaps and copy-on-write move a block of every pool.
        # The host pool (swap space, then the prefix cache's host tier) is block-major,
        # [blocks, layers, 2, block_size, H_kv, D], so that a run of host blocks is one
        # contiguous copy.
        self.kv_cache: Optional[torch.Tensor] = None
        self.kv_scales: Optional[torch.Tensor] = None
        self.host_kv_cache: Optional[torch.Tensor] = None
        self.host_kv_scales: Optional[torch.Tensor] = None
        # CUDA: the side stream host-to-device restores are staged on, and the event recorded on
        # the step's stream after the last device-to-host copies (what those restores wait for).
        self._copy_stream = None
        self._offloads_done = None
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        self.kv_cache_scales = config.cache.kv_cache_scales
        self.kv_dtype = kv_format.storage_dtype(self.kv_cache_dtype, self.dtype)
        self.sampler = Sampler()
        # (rows, metadata) of the last step whose metadata may serve again (_sampling_metadata).
        # One per batch in flight (pipeline parallelism alternates batches of different requests).
        self._meta_caches: collections.deque[tuple[list[SamplingRow], SamplingMetadata]] = collections.deque(
            maxlen=config.parallel.batches_in_flight)
        # The steps' block tables, updated in place where tables changed (block_table_array.py).
        self.block_tables = BlockTableArray()
        # Which KV cache group and pool slot each layer uses (kv_groups.py): one group until the
        # model is loaded and its layers' windows are known (set_kv_layout).
        self.kv_layout: KVLayout = single_group(model_config.num_hidden_layers)
        self.group_block_tables: list[BlockTableArray] = []
        self.graphs = None
        self.uniform_graphs = None  # UniformGraphRunner: verify steps of speculative decoding
        # Bytes per KV block of a second pool sized with this one (a draft model's), so that
        # the device's KV budget covers both.
        self.extra_kv_bytes_per_block = 0
        self.piecewise = None  # PiecewiseGraphRunner for steps with prefill chunks
        self.tracer = NULL_TRACER  # names the phases of a step for the profiler
        self.timings: dict[str, float] = {}
        self._slept_num_blocks = 0  # the pool's size while sleep() has freed it
        # Sleep mode on one GPU (sleep_memory.py): the weights and the KV pool live on regions
        # whose physical memory sleep gives back and wake_up maps again at the same addresses,
        # so the CUDA graphs survive. sleep_driver: the driver's bindings (None: not yet, or
        # not used: the CPU, or the driver refused: then sleep frees and wake_up recaptures).
        self.sleep_driver = None
        self._sleep_driver_tried = False
        self.weights_region: Optional[Region] = None
        self.kv_region: Optional[Region] = None
        self._weights_host: Optional[torch.Tensor] = None  # level 1: the weights region's bytes
        self._graph_addresses: dict[str, int] = {}  # what the graphs captured (tensor_addresses)
        # --enable-lora (rooflm/lora/): the adapters' host cache and device slots, and the step's
        # token -> slot map the model's hooks read; set when the model is loaded.
        self.lora = None
        self.lora_mapping = None
        self.expert_load = None  # ExpertLoadCounter under --count-expert-load with an MoE model
        if self.device.type == "cuda":
            # Any fp32 matmul (e.g. --dtype float32) on TF32 unless ROOFLM_TF32=0, which numerics
            # checks use to tell a logic difference from rounding (TF32 keeps 10 mantissa bits).
            tf32 = envs.get("ROOFLM_TF32")
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32

    def _make_backend(self):
        choice = self.config.runtime.attention_backend
        deterministic = self.config.runtime.deterministic
        if choice == "reference" or (choice == "auto" and self.device.type != "cuda"):
            if deterministic:  # one query token at a time (rooflm/deterministic/)
                from rooflm.deterministic.attention import RowwiseReferenceBackend
                return RowwiseReferenceBackend()
            if choice == "reference":
                return ReferenceBackend()
            from rooflm.layers.cpu_attention import CpuBackend
            return CpuBackend()  # the reference math, planned once a step
        from rooflm.layers.cuda_attention import TritonBackend
        from rooflm.kernels.fa4_prefill import fa4_enabled
        return TritonBackend(split_span=self.max_model_len, deterministic=deterministic,
                             prefill_fa4=fa4_enabled(self.config.runtime.prefill_attention, self.device))

    # ---- set-up ----------------------------------------------------------------------------

    def initialize(self, path: str, load_format: str) -> tuple[int, int, int]:
        """Everything before the first step, in the order it must happen: the weights, the KV
        pool sized from what they and the largest step leave free, the CUDA graphs (which
        hold the pool's addresses), the host pool for swapping and the prefix cache's host
        tier. Returns the number of device KV blocks, swap blocks and host-tier blocks, for
        the block manager."""
        self.check_memory(path, load_format)
        # Progress lines: start-up takes seconds to minutes, and a silent wait looks hung.
        logger.info("loading weights (%s, %s) on %s ...", load_format, path or "-", self.device)
        self.load_model(path, load_format)
        logger.info("weights loaded in %.1f s (%.0f MB)", self.timings["load_s"],
                    self.weight_bytes() / 1e6)
        self.set_kv_layout()
        if self.device.type == "cuda" and self.config.cache.num_blocks is None:
            logger.info("profiling memory: a forward of the largest step, to size the KV cache ...")
        num_blocks = self.determine_num_blocks()
        self.allocate_kv_cache(num_blocks, sleepable=True)
        if self.device.type == "cuda" and not self.config.runtime.enforce_eager:
            logger.info("capturing CUDA graphs ...")
        self.capture_graphs()
        num_host = self.num_host_blocks()
        num_offload = self.num_offload_blocks()
        self.allocate_host_cache(num_host + num_offload)
        if num_offload:
            logger.info("prefix cache host tier: %d blocks (%d tokens, %.2f GiB%s)", num_offload,
                        num_offload * self.block_size, num_offload * self.kv_bytes_per_block() / 2**30,
                        ", pinned" if self.device.type == "cuda" else "")
        return num_blocks, num_host, num_offload

    def hybrid_kv_off_reason(self) -> Optional[str]:
        """Why every layer keeps its whole history in one table, or None (kv_groups.py)."""
        if self.config.cache.disable_hybrid_kv_cache_manager:
            return "--disable-hybrid-kv-cache-manager"
        if self.tp.size > 1:
            return "tensor parallelism sends one block table per step"
        if self.stage is not None:
            return "pipeline parallelism sends one block table per step"
        if self.config.speculative.speculative_method:
            return "speculative decoding's proposers and device loop read one block table"
        return None

    def set_kv_layout(self) -> None:
        """The KV cache groups of the loaded model's layers: sliding-window layers in groups of
        their own, which hold only their window, unless hybrid_kv_off_reason says why not."""
        windows = [layer.self_attn.attn.sliding_window if hasattr(layer, "self_attn") else None
                   for layer in self.model.model.layers]  # another pipeline stage's layer: None
        reason = self.hybrid_kv_off_reason()
        self.kv_layout = kv_layout(windows, self.max_model_len, hybrid=reason is None)
        self.group_block_tables = [BlockTableArray() for _ in range(self.kv_layout.num_groups - 1)]
        if self.kv_layout.hybrid:
            logger.info("KV cache groups: %s, %d layers a block (sliding-window layers hold only their window)",
                        ", ".join("full" if w is None else f"window {w}" for w in self.kv_layout.windows),
                        self.kv_layout.group_size)
        elif reason is not None and any(w is not None and w < self.max_model_len for w in windows):
            logger.info("sliding-window layers keep their whole history: %s", reason)

    def keeps_quantized(self) -> bool:
        """GGUF blocks stay quantized where a kernel takes them (rooflm/quant/), under auto or
        gguf: the CPU's block matmuls; on one CUDA device the Triton W4A16/W8A16 kernels (their
        GPU tests passed on H100 x2, 2026-11-25; no tensor-parallel sharding of blocks yet)."""
        mode = self.config.load.quantization
        if mode not in ("auto", "gguf"):
            return False
        return self.device.type == "cpu" or (self.device.type == "cuda" and self.tp.size == 1)

    def check_memory(self, path: str, load_format: str) -> None:
        """Refuse a load that cannot fit, before anything is allocated (engine/memory_check.py)."""
        import os

        from rooflm.engine.memory_check import MemoryNeed, available_bytes, check_fits

        cfg, sched = self.model_config, self.config.scheduler
        elem = self.dtype.itemsize
        weights = cfg.num_params() * elem // self.world.size  # about: norms are replicated
        if load_format == "gguf" and self.keeps_quantized():
            # At most the file's blocks plus the embedding in float (its lookup table). On CUDA
            # the kernels' form is up to 4/3 of the file (Q4_K: fp32 scales and zeros per 32,
            # 6 bits a weight against the file's 4.5; formats.from_gguf_blocks).
            blocks = os.path.getsize(path) * (4 / 3 if self.device.type == "cuda" else 1)
            weights = min(weights, int(blocks) + cfg.vocab_size * cfg.hidden_size * elem)
        kv = 0
        if self.device.type == "cpu":
            kv = (self.determine_num_blocks() + self.num_host_blocks()
                  + self.num_offload_blocks()) * self.kv_bytes_per_block()
        tokens = min(sched.max_num_batched_tokens, self.max_model_len * sched.max_num_seqs)
        need = MemoryNeed(weights, kv, step_activation_bytes(cfg, tokens, sched.max_num_seqs, elem),
                          self.device.type)
        check_fits(need, available_bytes(self.device), self.config.load.model or "the default model",
                   self.dtype)

    def load_model(self, path: str, load_format: str) -> None:
        from rooflm.model.loader import iter_weights
        from rooflm.model.registry import get_model_class

        t0 = time.perf_counter()
        cls = get_model_class(self.model_config.architecture)
        # Parameters are created on the device in their final dtype: no host fp32 copy.
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                # --enable-expert-parallel reaches the MoE blocks only (dense families take no such
                # argument): whole experts per rank instead of a slice of every expert
                ep = {"expert_parallel": True} if self.config.parallel.enable_expert_parallel else {}
                model = cls(self.model_config, max_positions=self.max_model_len, backend=self.backend,
                            kernels=self._make_kernels(), tp=self.tp,
                            stage=None if self.stage is None else self.stage.layout, **ep)
        finally:
            torch.set_default_dtype(prev)
        if self.tp.size > 1:
            # Each rank narrows every tensor to its part as it comes (safetensors: reading only
            # those bytes); dummy weights are the single-device model's, drawn one at a time.
            weights = (model.dummy_weights(self.config.load.seed) if load_format == "dummy"
                       else iter_weights(path, load_format, lazy=True))
            model.load_weights(weights)
        elif load_format == "dummy" and self.stage is not None:  # a stage's part of the same draws
            model.load_weights(model.dummy_weights(self.config.load.seed))
        elif load_format == "dummy":
            model.init_dummy_weights(self.config.load.seed)
        else:
            # Quantized blocks only where a kernel takes them: the CPU (rooflm/quant/).
            model.load_weights(iter_weights(path, load_format, keep_quantized=self.keeps_quantized()))
        if self.config.load.quantization.startswith("int"):
            from rooflm.model.quantize_on_load import quantize_int
            quantize_int(model, self.config.load.quantization)
        elif self.config.load.quantization == "fp8":
            from rooflm.model.quantize_on_load import quantize_fp8
            quantize_fp8(model)
        self.model = model.eval()
        if self.config.runtime.count_expert_load:
            from rooflm.layers.moe import attach_expert_load_counter
            sched, spec = self.config.scheduler, self.config.speculative
            rows = max(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + spec.num_speculative_tokens))
            self.expert_load = attach_expert_load_counter(self.model, self.device, rows)
        if self.config.lora.enable_lora:
            self._install_lora()
        driver = self._sleep_driver()
        if driver is not None:
            self.weights_region = adopt_tensors(self.model, driver, "weights", release=self._release_cached)
            self._release_cached()
        self.timings["load_s"] = time.perf_counter() - t0

    def _sleep_driver(self):
        """The driver sleep mode's regions come from (sleep_memory.py), or None: sleep mode off,
        not one CUDA device (tensor and pipeline parallelism refuse sleep mode), or the
        driver's virtual memory calls unavailable (logged once; sleep then frees the tensors
        and wake_up captures the graphs again)."""
        if self.sleep_driver is not None or self._sleep_driver_tried:
            return self.sleep_driver
        self._sleep_driver_tried = True
        if (not self.config.runtime.enable_sleep_mode or self.device.type != "cuda" or self.tp.size > 1
                or self.stage is not None):
            return None
        try:
            self.sleep_driver = CuMemDriver(self.device)
        except (OSError, AttributeError, RuntimeError) as exc:
            logger.warning("sleep mode without CUDA virtual memory (%s): wake_up will capture the CUDA "
                           "graphs again", exc)
        return self.sleep_driver

    def _release_cached(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _install_lora(self) -> None:
        """LoRA hooks on the decoder's targeted linears, a slot pool of --max-loras adapters."""
        from rooflm.lora.hook import install_lora
        from rooflm.lora.manager import LoRAManager
        from rooflm.lora.mapping import LoRAMapping

        cfg = self.config.lora
        self.lora_mapping = LoRAMapping(self.device)
        hooks, pool = install_lora(self.model, self.lora_mapping, cfg.max_loras, cfg.max_lora_rank,
                                   use_triton=self.device.type == "cuda")
        self.lora = LoRAManager(self.model_config, cfg, hooks, pool)
        logger.info("LoRA: %d slots of rank %d on %d linears, host cache of %d adapters",
                    cfg.max_loras, cfg.max_lora_rank, len(hooks), cfg.host_cache_size)

    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer of the model as stored (quantized ones included)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def linear_bytes_per_weight(self) -> float:
        """Bytes per weight of the decoder layers' linear layers, from the tensors themselves
        (quantized blocks and scales included): what a decode step streams per weight
        (EngineInfo.weight_dtype_bytes, hence MBU)."""
        from rooflm.layers.linear import Linear
        from rooflm.layers.moe import Experts

        stored = weights = 0
        for module in self.model.model.layers.modules():
            if isinstance(module, Linear):
                stored += module.stored_weight_bytes()
                weights += module.in_features * module.out_features
            elif isinstance(module, Experts):  # stacked experts: fp8 codes + scales once quantized
                stored += module.stored_weight_bytes()
                weights += module.weight_count()
        return stored / weights if weights else float(self.dtype.itemsize)

    def matmul_dtype(self) -> str:
        """"fp8" when the decoder's linears run W8A8, "int8" when they run in the CPU's native
        block kernels (int8 activations: their roof is the measured block-dot rate, perf/gpus.py),
        else "" (EngineInfo.matmul_dtype)."""
        from rooflm.layers.linear import Linear
        from rooflm.layers.moe import Experts
        from rooflm.quant.linear_method import NativeBlockLinear
        quants = [m.quant for m in self.model.model.layers.modules() if isinstance(m, Linear) and m.quant is not None]
        formats = {getattr(q, "format", "") for q in quants}
        formats |= {m.quant_format for m in self.model.model.layers.modules() if isinstance(m, Experts)}
        if "fp8" in formats:
            return "fp8"
        return "int8" if any(isinstance(q, NativeBlockLinear) for q in quants) else ""

    def head_bytes_per_weight(self) -> float:
        """Bytes per LM head weight as stored: its own Linear, or for a tied head the
        embedding's table, or the quantized copy of it the CPU path multiplies with."""
        head = getattr(self.model, "lm_head", None)
        if head is not None:
            return head.stored_weight_bytes() / (head.in_features * head.out_features)
        quant = getattr(self.model, "tied_head_quant", None)
        if quant is not None:
            return quant.weight_bytes() / (quant.in_features * quant.out_features)
        return float(self.model.model.embed_tokens.weight.element_size())

    def _make_kernels(self) -> Kernels:
        """Triton's fused kernels with the Triton attention backend (CUDA), else torch;
        --deterministic: the batch-invariant set (rooflm/deterministic/)."""
        if self.config.runtime.deterministic:
            from rooflm.deterministic import deterministic_kernels
            return deterministic_kernels("cuda" if self.backend.name == "triton" else "cpu")
        if self.backend.name in ("reference", "cpu"):
            return TORCH_KERNELS
        return triton_kernels(self.config.runtime.decode_gemv)

    def kv_bytes_per_element(self) -> float:
        """Bytes per stored K or V element, FP8 per-token scales included."""
        return kv_format.bytes_per_element(self.kv_cache_dtype, self.dtype, self.model_config.head_dim,
                                           self.kv_scale_mode() != "static")

    def kv_scale_mode(self) -> str:
        """'per-token' or 'static' for an FP8 cache (layers/kv_cache.py), '' for another."""
        if not kv_format.is_fp8(self.kv_cache_dtype):
            return ""
        has = self.model is not None and getattr(self.model, "checkpoint_kv_scales", None) is not None
        return kv_format.resolve_kv_scales(self.kv_cache_scales, has)

    def _static_kv_scales(self, quiet: bool) -> torch.Tensor:
        """[layers, 2, H_kv] fp32: the checkpoint's per-tensor scales for this rank's heads, or 1.0."""
        layers = self.model_config.num_hidden_layers
        scales = getattr(self.model, "checkpoint_kv_scales", None)
        if scales is None:
            if not quiet:
                logger.warning("FP8 KV cache with static scales of 1.0 (the checkpoint has none): keys "
                               "over 448 saturate and values under 2^-6 lose precision; --kv-cache-scales "
                               "per-token scales each token instead")
            scales = torch.ones(layers, 2)
        return scales[:, :, None].expand(layers, 2, self.num_kv_heads).contiguous().to(self.device)

    def kv_bytes_per_block(self) -> int:
        """This rank's bytes per block: its KV heads only, of the layers a block holds (all of
        them, or one KV cache group's: kv_groups.py)."""
        whole = self.model_config.kv_bytes_per_token(self.kv_bytes_per_element()) * self.block_size
        layers = self._pool_layers() / self.model_config.num_hidden_layers
        return round(whole * layers * self.num_kv_heads / self.model_config.num_key_value_heads)

    def _pool_layers(self) -> int:
        """Layers a KV block holds here: a KV cache group's, or a pipeline stage's."""
        return self.kv_layout.group_size if self.stage is None else self.stage.end - self.stage.start

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self.kv_bytes_per_block() + self.extra_kv_bytes_per_block
        if self.device.type == "cuda":
            peak_activations = self.profile_run()
            free, total = torch.cuda.mem_get_info(self.device)
            # What the process holds now (weights) stays; the KV pool gets the rest of the
            # budget after the activation peak of the largest step, the decode graphs' logits
            # and a margin for the graphs' other activations.
            graphs = self.graph_logits_bytes()
            budget = free - (1 - cache.gpu_memory_utilization) * total - peak_activations - graphs - 2**28
            logger.info("KV budget %.2f GiB (free %.2f GiB, activation peak %.2f GiB, graph logits %.2f GiB)",
                        budget / 2**30, free / 2**30, peak_activations / 2**30, graphs / 2**30)
        else:
            budget = cache.cpu_kv_cache_gb * 2**30
        # No point holding more than every sequence at full length.
        cap = kv_blocks_cap(self.config.scheduler.max_num_seqs, self.max_model_len, self.block_size)
        if self.kv_layout.hybrid:
            cap = self.config.scheduler.max_num_seqs * blocks_per_seq(self.kv_layout, self.max_model_len,
                                                                      self.block_size)
        # Every rank's pool has the same number of blocks (one block table for all): the least.
        return self.world.min_over_ranks(max(1, min(int(budget // per_block), cap)))

    def graph_logits_bytes(self) -> int:
        """What the decode CUDA graphs' LM head holds outside the profiled step: the fp32 logits
        buffer of the largest captured batch (cuda_graph.py) and, in the graphs' own pool, its
        logits in the weights' dtype before they are widened (2 bytes). 0 without graphs."""
        if self.device.type != "cuda" or self.config.runtime.enforce_eager or self.stage is not None:
            return 0
        return self._graph_max_batch() * self.model_config.vocab_size * (4 + 2)

    def _graph_max_batch(self) -> int:
        """The largest decode batch captured as a CUDA graph."""
        return min(self.config.runtime.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Peak activation bytes of the largest step: a prefill of max_num_batched_tokens tokens
        plus the LM head and sampler over max_num_seqs rows, on a scratch KV cache."""
        t0 = time.perf_counter()
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, self.max_model_len * sched.max_num_seqs)
        seq_len = min(num_tokens, self.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks_per_seq = -(-seq_len // self.block_size)
        self.allocate_kv_cache(blocks_per_seq * len(lens), quiet=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        starts, slots, tables, positions = [0], [], [], []
        for i, n in enumerate(lens):
            starts.append(starts[-1] + n)
            positions.extend(range(n))
            table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            tables.append(table)
            slots.extend(slot_mapping(table, 0, n, self.block_size))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev), query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev), max_query_len=max(lens),
            max_seq_len=max(lens), num_decodes=0, query_start_loc_cpu=starts, seq_lens_cpu=lens)
        ids = torch.randint(0, self.model_config.vocab_size, (num_tokens,), device=dev)
        hidden = self._profile_forward(ids, torch.tensor(positions, device=dev), meta)
        rows = min(sched.max_num_seqs, num_tokens)
        logits = None
        if self.stage is None or self.stage.is_first:  # the LM head and the sampler's rank
            logits = self.model.compute_logits(hidden[:rows])
            torch.softmax(logits, -1).argmax(-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden, logits
        self.kv_cache = self.kv_caches = self.kv_scales = None
        torch.cuda.empty_cache()
        self.timings["profile_s"] = time.perf_counter() - t0
        return peak

    def _profile_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward for profile_run; a pipeline stage after the first runs its layers
        on random hidden states of the step's shape (the activations it would receive)."""
        if self.stage is None:
            return self.model(ids, positions, self.kv_caches, meta)
        intermediate = None
        if not self.stage.is_first:
            x = torch.randn((ids.shape[0], self.model_config.hidden_size), dtype=self.dtype, device=ids.device)
            intermediate = (x, torch.zeros_like(x))
        out = self.model(ids, positions, self.kv_caches, meta, intermediate=intermediate)
        return out if self.stage.is_last else out[0]

    def allocate_kv_cache(self, num_blocks: int, quiet: bool = False, sleepable: bool = False) -> None:
        """The device pool. sleepable: on a region of the sleep driver when there is one (the
        engine's pool; profile_run's scratch pool is a plain allocation)."""
        cfg = self.model_config
        # One slot per layer of a block: all layers, or a KV cache group's (kv_groups.py). Zeroed:
        # a sliding group's given-back entries point at block 0, which the kernels may read
        # (masked), so it must hold finite values before anything is written.
        shape = (self._pool_layers(), 2, num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        mode = self.kv_scale_mode()
        driver = self._sleep_driver() if sleepable else None
        if self.kv_region is not None:  # never while graphs hold it: only initialize asks twice
            self.kv_region.close()
            self.kv_region = None
        if driver is not None:
            try:
                self._kv_on_region(driver, shape, mode == "per-token")
            except RuntimeError as exc:  # a driver call refused: a plain pool, graphs captured at wake
                logger.warning("KV pool off CUDA virtual memory (%s): wake_up will capture the CUDA graphs "
                               "again", exc)
                if self.kv_region is not None:
                    self.kv_region.close()
                self.kv_region = None
                driver = None
        if driver is None:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            self.kv_scales = None
            if mode == "per-token":
                self.kv_scales = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)
        if mode == "static":
            self.kv_scales = self._static_kv_scales(quiet)
        held = range(cfg.num_hidden_layers) if self.stage is None else range(self.stage.start, self.stage.end)
        self.kv_caches = [self._layer_cache(i) if i in held else None for i in range(cfg.num_hidden_layers)]
        if not quiet:
            logger.info("KV cache: %d blocks of %d tokens, %s%s (%.2f GiB)", num_blocks, self.block_size,
                        str(self.kv_dtype).replace("torch.", ""), f", {mode} scales" if mode else "",
                        num_blocks * self.kv_bytes_per_block() / 2**30)

    def _kv_on_region(self, driver, shape: tuple, per_token_scales: bool) -> None:
        """The pool (and per-token scales) on one region, zeroed."""
        self.kv_cache = self.kv_scales = None  # a pool being replaced is given back first
        self._release_cached()
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        cache_bytes = round_up(int(np.prod(shape)) * elem, ALIGN)
        scale_bytes = int(np.prod(shape[:-1])) * 4 if per_token_scales else 0
        region = self.kv_region = Region(driver, "kv cache", cache_bytes + scale_bytes, chunk=WAKE_CHUNK_BYTES)
        region.map_all()
        self.kv_cache = region.tensor(0, shape, self.kv_dtype).zero_()
        if per_token_scales:
            self.kv_scales = region.tensor(cache_bytes, shape[:-1], torch.float32).zero_()

    def _layer_cache(self, layer: int) -> KVCache:
        layout = self.kv_layout
        group = layout.group_of_layer(layer)
        slot = layout.groups[group].layers.index(layer) if self.stage is None else layer - self.stage.start
        k, v = self.kv_cache[slot, 0], self.kv_cache[slot, 1]
        if self.kv_scales is None:
            return KVCache(k, v, group=group)
        # Per-token scales live in the block's slot; static ones belong to the layer.
        i = slot if self.kv_scale_mode() == "per-token" else layer
        return KVCache(k, v, self.kv_scales[i, 0], self.kv_scales[i, 1], group=group)

    def allocate_host_cache(self, num_blocks: int) -> None:
        """The host pool, block-major; empty, not zeroed: a host block is read only after a
        copy wrote it (a swap-out, an offload), and zeroing pinned GiBs costs start-up time."""
        if num_blocks <= 0:
            return
        pin = self.device.type == "cuda"
        shape = (num_blocks, self.kv_cache.shape[0], 2) + tuple(self.kv_cache.shape[3:])
        self.host_kv_cache = torch.empty(shape, dtype=self.kv_dtype, pin_memory=pin)
        if self.kv_scale_mode() == "per-token":
            self.host_kv_scales = torch.empty(shape[:-1], dtype=torch.float32, pin_memory=pin)

    def _pools(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(device pool, host pool) pairs whose blocks move together: a block is dimension 2
        of a device pool and dimension 0 of a host pool."""
        pools = [(self.kv_cache, self.host_kv_cache)]
        if self.kv_scale_mode() == "per-token":  # static scales belong to no block
            pools.append((self.kv_scales, self.host_kv_scales))
        return pools

    def num_host_blocks(self) -> int:
        if self.config.scheduler.preemption_mode != "swap":
            return 0
        return int(self.config.cache.swap_space_gb * 2**30 // self.kv_bytes_per_block())

    def num_offload_blocks(self) -> int:
        """Blocks of the prefix cache's host tier (--kv-offload-gb). Unset: none on the CPU
        (the device pool is host memory already), KV_OFFLOAD_AUTO_SHARE of the host's
        available memory on CUDA, the least over the tensor-parallel ranks."""
        cache = self.config.cache
        if not cache.enable_prefix_caching:
            return 0
        gb = cache.kv_offload_gb
        if gb is not None:
            return int(gb * 2**30 // self.kv_bytes_per_block())
        if self.device.type != "cuda":
            return 0
        from rooflm.engine.memory_check import available_bytes

        available = available_bytes(torch.device("cpu")) or 0
        share = min(KV_OFFLOAD_AUTO_SHARE * available / self.world.size, KV_OFFLOAD_AUTO_MAX_GB * 2**30)
        return self.world.min_over_ranks(int(share // self.kv_bytes_per_block()))

    # ---- a step ----------------------------------------------------------------------------

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """Swaps, the host tier's offloads and restores, and copy-on-write copies, before the
        forward pass writes new K/V, in this order on the step's stream: every device-to-host
        copy reads its block before anything of this step writes one (a popped block's
        offload before its new contents), and a restore reads its host block after an
        offload of the same step wrote it.

        On CUDA the slow half of a restore, host to device over PCIe, is issued first on a side
        stream into a staging buffer, so it runs while the step before this one (still on the
        device under async scheduling) computes; the step's stream waits for that step's copies
        alone (an event) and scatters the staging into the pool in its own order, after the
        offloads: no block of the pool is touched off the step's stream. The side stream waits
        for earlier steps' device-to-host copies (they may have written the host blocks it
        reads); a restore whose host block this step's own offloads write, and restores beyond
        RESTORE_AHEAD_BYTES, go the in-order way after the offloads."""
        ahead, in_order = self._split_restores(out)
        staged = self._stage_restores(ahead) if ahead else None
        if out.blocks_to_swap_out:
            self._copy_to_host(out.blocks_to_swap_out)
            if self.device.type == "cuda":
                self._offloads_done = torch.cuda.Event()
                self._offloads_done.record()
        if staged is not None:
            self._scatter_staged(*staged)
        if in_order:
            self._copy_from_host(in_order)
        if out.blocks_to_copy:
            # Through pinned memory: a pageable copy would wait here for the step in flight.
            src = self._host([s for s, _ in out.blocks_to_copy], torch.int64).to(self.device, non_blocking=True)
            dst = self._host([d for _, d in out.blocks_to_copy], torch.int64).to(self.device, non_blocking=True)
            for pool, _ in self._pools():
                pool[:, :, dst] = pool[:, :, src]

    def _host_copy_chunks(self, pairs: list[tuple[int, int]], host_index: int) -> list[list[tuple[int, int]]]:
        """The pairs in order of their host block (stable: a host block written twice in a step
        keeps its last write), cut into chunks of at most HOST_COPY_CHUNK_BYTES."""
        per_block = sum(host.stride(0) * host.element_size() for _, host in self._pools())
        size = max(1, HOST_COPY_CHUNK_BYTES // per_block)
        ordered = sorted(pairs, key=lambda p: p[host_index])
        return [ordered[i:i + size] for i in range(0, len(ordered), size)]

    def _copy_to_host(self, pairs: list[tuple[int, int]]) -> None:
        """(device, host) blocks: per chunk one gather on the device into block-major order,
        then one non_blocking copy per run of consecutive host blocks (pinned: the host does
        not wait; the host pool is written only by copies on this stream, and read on the copy
        stream only after an event that follows them: _stage_restores)."""
        for chunk in self._host_copy_chunks(pairs, 1):
            dev = self._host([d for d, _ in chunk], torch.int64).to(self.device, non_blocking=True)
            runs = _runs([h for _, h in chunk])
            for pool, host_pool in self._pools():
                pool, host_pool = _as_bytes(pool), _as_bytes(host_pool)
                staged = pool.movedim(2, 0)[dev]  # [n, layers, 2, block_size, ...], one kernel
                for i, h, k in runs:
                    host_pool[h:h + k].copy_(staged[i:i + k], non_blocking=True)

    def _split_restores(self, out: SchedulerOutput) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(host, device) restores to stage ahead on the copy stream, and those to copy in order."""
        pairs = out.blocks_to_swap_in
        if not pairs or self.device.type != "cuda":
            return [], list(pairs)
        written = {h for _, h in out.blocks_to_swap_out}
        per_block = sum(host.stride(0) * host.element_size() for _, host in self._pools())
        room = max(1, RESTORE_AHEAD_BYTES // per_block)
        ahead, in_order = [], []
        for pair in pairs:
            (ahead if pair[0] not in written and len(ahead) < room else in_order).append(pair)
        return ahead, in_order

    def _stage_restores(self, pairs: list[tuple[int, int]]):
        """Host-to-device copies of the restores' host blocks into staging tensors, on the copy
        stream; returns (chunks with their staging tensors, the event that marks them done)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        side, step_stream = self._copy_stream, torch.cuda.current_stream(self.device)
        if self._offloads_done is not None:
            side.wait_event(self._offloads_done)
        staged = []
        with torch.cuda.stream(side):
            for chunk in self._host_copy_chunks(pairs, 0):
                runs = _runs([h for h, _ in chunk])
                tensors = []
                for pool, host_pool in self._pools():
                    pool, host_pool = _as_bytes(pool), _as_bytes(host_pool)
                    t = torch.empty((len(chunk),) + tuple(host_pool.shape[1:]), dtype=pool.dtype,
                                    device=self.device)
                    for i, h, k in runs:
                        t[i:i + k].copy_(host_pool[h:h + k], non_blocking=True)
                    # Read on the step's stream: the allocator must not hand it out again
                    # before that use is done.
                    t.record_stream(step_stream)
                    tensors.append(t)
                staged.append((chunk, tensors))
            done = torch.cuda.Event()
            done.record(side)
        return staged, done

    def _scatter_staged(self, staged, done) -> None:
        """On the step's stream, once the staging copies are done: one scatter per pool."""
        torch.cuda.current_stream(self.device).wait_event(done)
        for chunk, tensors in staged:
            dev = self._host([d for _, d in chunk], torch.int64).to(self.device, non_blocking=True)
            for (pool, _), t in zip(self._pools(), tensors):
                _as_bytes(pool).index_copy_(2, dev, t.movedim(0, 2))

    def _copy_from_host(self, pairs: list[tuple[int, int]]) -> None:
        """(host, device) blocks: per chunk one non_blocking copy per run of consecutive host
        blocks into a device staging tensor, then one scatter into the pool."""
        for chunk in self._host_copy_chunks(pairs, 0):
            dev = self._host([d for _, d in chunk], torch.int64).to(self.device, non_blocking=True)
            runs = _runs([h for h, _ in chunk])
            for pool, host_pool in self._pools():
                pool, host_pool = _as_bytes(pool), _as_bytes(host_pool)
                staged = torch.empty((len(chunk),) + tuple(host_pool.shape[1:]), dtype=pool.dtype,
                                     device=self.device)
                for i, h, k in runs:
                    staged[i:i + k].copy_(host_pool[h:h + k], non_blocking=True)
                pool.index_copy_(2, dev, staged.movedim(0, 2))

    def prepare(self, out: SchedulerOutput, suppress: dict[int, tuple[int, ...]]) -> StepInputs:
        inputs = self._prepare_decodes(out, suppress)
        if inputs is not None:
            return inputs
        # Decodes (one query token) first: the attention backend splits the batch there.
        order = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        num_decodes = sum(1 for s in order if s.num_new_tokens == 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        rows: list[SamplingRow] = []
        row_owner: list[ScheduledSeq] = []
        spans: list[tuple[ScheduledSeq, int, int, int]] = []
        pending: list[tuple[int, int]] = []
        spec_rows: list[tuple[int, int]] = []
        for sch in order:
            seq, start, n = sch.seq, sch.start, sch.num_new_tokens
            base = len(input_ids)
            req = sch.request
            if n == 1:  # a decode row (most rows): no slices or ranges
                if start < len(seq.token_ids):
                    input_ids.append(seq.token_ids[start])
                else:  # sampled last step, id still on the device
                    pending.append((base, seq.seq_id))
                    input_ids.append(0)
                positions.append(start)
                slots.append(seq.block_table.slot(start))
            elif sch.spec_token_ids:  # the last token, then the drafts to verify
                input_ids.append(seq.token_ids[start])
                input_ids.extend(sch.spec_token_ids)
                positions.extend(range(start, start + n))
                slots.extend(seq.block_table.slots(start, n))
            else:
                known = seq.token_ids[start:start + n]
                input_ids.extend(known)
                for j in range(len(known), n):  # a token sampled last step, id still on the device
                    pending.append((base + j, seq.seq_id))
                    input_ids.append(0)
                positions.extend(range(start, start + n))
                slots.extend(seq.block_table.slots(start, n))
            query_start.append(base + n)
            seq_lens.append(start + n)
            if req.prompt_logprobs is not None and not req.forked:
                # Position p's logits score prompt token p + 1; entries already made
                # (before a preemption) are not made again.
                first = max(start, len(req.prompt_logprobs) - 1)
                count = min(start + n, seq.num_prompt_tokens - 1) - first
                if count > 0:
                    spans.append((sch, base + first - start, first, count))
            if sch.spec_token_ids:
                self._spec_rows(sch, base, logits_indices, rows, row_owner, spec_rows, suppress)
            elif sch.completes:
                # A forking prompt samples its n first tokens, one row per sample.
                samples = range(req.params.n) if req.needs_fork else (seq.index,)
                for index in samples:
                    logits_indices.append(base + n - 1)
                    rows.append(SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids,
                                            req.generator(index), suppress.get(seq.seq_id, ())))
                    row_owner.append(sch)
        tables = self.block_tables.gather([s.seq.block_table for s in order])
        host = self._host_inputs(input_ids, positions, slots, query_start, seq_lens, tables)
        host.groups = self._group_inputs(order)
        return StepInputs(host=host, query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens,
                          max_query_len=max(s.num_new_tokens for s in order), num_decodes=num_decodes,
                          order=order, logits_indices=logits_indices, rows=rows, row_owner=row_owner,
                          prompt_logprob_spans=spans, pending_positions=pending, spec_rows=spec_rows)

    def _host_inputs(self, input_ids: list[int], positions: list[int], slots: list[int],
                     query_start: list[int], seq_lens: list[int], tables) -> HostInputs:
        return HostInputs(
            input_ids=self._host(input_ids, torch.int64), positions=self._host(positions, torch.int64),
            slot_mapping=self._host(slots, torch.int64), query_start_loc=self._host(query_start, torch.int32),
            seq_lens=self._host(seq_lens, torch.int32), block_tables=self._pin(torch.from_numpy(tables)))

    def _prepare_decodes(self, out: SchedulerOutput, suppress: dict[int, tuple[int, ...]]) -> Optional[StepInputs]:
        """prepare() for a step of plain decodes only (the steady state of a large batch): one
        token and one sampling row per sequence, no drafts, forks or prompt logprobs. The same
        inputs as the general loop, in one pass without its branches and ranges; None when a
        row is anything else, and the general loop runs."""
        order = out.scheduled  # all decodes: sorting them first keeps this order
        if not order or order[-1].num_new_tokens != 1:
            return None  # admitted prompts come last: a mixed step is usually seen here at once
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[SamplingRow] = []
        pending: list[tuple[int, int]] = []
        for i, sch in enumerate(order):
            req, seq, start = sch.request, sch.seq, sch.start
            if (sch.num_new_tokens != 1 or not sch.completes or sch.spec_token_ids or req.needs_fork
                    or req.prompt_logprobs is not None):
                return None
            token_ids = seq.token_ids
            if start < len(token_ids):
                input_ids.append(token_ids[start])
            else:  # sampled last step, id still on the device
                pending.append((i, seq.seq_id))
                input_ids.append(0)
            positions.append(start)
            slots.append(slot_of(seq.block_table.ids[start // block_size], start, block_size))
            rows.append(SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids,
                                    req.generators[seq.index] if req.generators else None,
                                    suppress.get(seq.seq_id, ()) if suppress else ()))
        num_seqs = len(order)
        query_start = list(range(num_seqs + 1))
        seq_lens = [p + 1 for p in positions]
        tables = self.block_tables.gather([s.seq.block_table for s in order])
        host = self._host_inputs(input_ids, positions, slots, query_start, seq_lens, tables)
        host.groups = self._group_inputs(order)
        return StepInputs(host=host, query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens,
                          max_query_len=1, num_decodes=num_seqs, order=list(order),
                          logits_indices=list(range(num_seqs)), rows=rows, row_owner=list(order),
                          prompt_logprob_spans=[], pending_positions=pending)

    def _group_inputs(self, order: list[ScheduledSeq]) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Each further KV cache group's (slot_mapping, block_tables) of the step: the same
        positions as group 0's, through the group's own tables."""
        groups = []
        for g, array in enumerate(self.group_block_tables):
            tables = [sch.seq.block_table.group_tables[g] for sch in order]
            slots: list[int] = []
            for sch, table in zip(order, tables):
                if sch.num_new_tokens == 1:
                    slots.append(table.slot(sch.start))
                else:
                    slots.extend(table.slots(sch.start, sch.num_new_tokens))
            groups.append((self._host(slots, torch.int64), self._pin(torch.from_numpy(array.gather(tables)))))
        return tuple(groups)

    @staticmethod
    def _spec_rows(sch: ScheduledSeq, base: int, logits_indices: list[int], rows: list[SamplingRow],
                   row_owner: list[ScheduledSeq], spec_rows: list[tuple[int, int]],
                   suppress: dict[int, tuple[int, ...]]) -> None:
        """A verifying sequence's 1 + k sampling rows: row j is the logits after draft j, and
        its history (for penalties) holds the drafts before it."""
        req, seq, drafts = sch.request, sch.seq, sch.spec_token_ids
        spec_rows.append((len(rows), len(drafts)))
        for j in range(len(drafts) + 1):
            logits_indices.append(base + j)
            history = seq.output_token_ids + drafts[:j] if j else seq.output_token_ids
            rows.append(SamplingRow(req.params, req.prompt_token_ids, history, req.generator(seq.index),
                                    suppress.get(seq.seq_id, ())))
            row_owner.append(sch)

    def _set_lora_mapping(self, inputs: StepInputs) -> None:
        """The step's token -> adapter slot map, once for every hook: the step's adapters get
        slots first (a cold one is copied from the host cache into its slot)."""
        adapters = {sch.request.lora_request for sch in inputs.order} - {None}
        if not adapters:
            self.lora.step_writes = []
            self.lora_mapping.clear()
            return
        slot_of = self.lora.activate(adapters)
        token_slots: list[int] = []
        starts = inputs.query_start_loc_cpu
        for i, sch in enumerate(inputs.order):
            adapter = sch.request.lora_request
            token_slots.extend([-1 if adapter is None else slot_of[adapter]] * (starts[i + 1] - starts[i]))
        self.lora_mapping.set_step(token_slots, decode_only=inputs.num_decodes == len(inputs.order))

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        # Pinned host memory makes the copies below asynchronous; torch caches the pages.
        return t.pin_memory() if self.device.type == "cuda" else t

    def _host(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        # Through numpy: torch.tensor(list) took 11 us for 256 ints where np.array takes 3.5
        # (2-core CPU), and a step makes several of these.
        return self._pin(torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype])))

    def to_device(self, inputs: "StepInputs") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        h, dev = inputs.host, self.device
        meta = AttentionMetadata(
            slot_mapping=h.slot_mapping.to(dev, non_blocking=True),
            query_start_loc=h.query_start_loc.to(dev, non_blocking=True),
            seq_lens=h.seq_lens.to(dev, non_blocking=True),
            block_tables=h.block_tables.to(dev, non_blocking=True),
            max_query_len=inputs.max_query_len, max_seq_len=max(inputs.seq_lens_cpu),
            num_decodes=inputs.num_decodes, query_start_loc_cpu=inputs.query_start_loc_cpu,
            seq_lens_cpu=inputs.seq_lens_cpu)
        if h.groups:
            meta.groups = [meta.with_tables(slots.to(dev, non_blocking=True), tables.to(dev, non_blocking=True))
                           for slots, tables in h.groups]
        return h.input_ids.to(dev, non_blocking=True), h.positions.to(dev, non_blocking=True), meta

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, suppress: dict[int, tuple[int, ...]]) -> StepResult:
        """Run a step and wait for its results (the synchronous path)."""
        return self.collect(self.launch(out, suppress, None))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, suppress: dict[int, tuple[int, ...]],
               prev: Optional["StepHandle"]) -> "StepHandle":
        """Queue a step's work on the device without waiting for it.

        Tokens the previous step sampled but the host has not read yet (pending) are
        filled into this step's inputs on the device, from prev's sampled ids."""
        with self.tracer.phase("block_ops"):
            self.apply_block_ops(out)
        with self.tracer.phase("prepare"):
            inputs = self.prepare(out, suppress)
            if self.lora is not None:
                self._set_lora_mapping(inputs)
        if self.step_channel is not None:
            with self.tracer.phase("broadcast"):
                self._send_step(out, inputs, prev)
        fixup = self._pending_fixup(inputs, prev)
        if self.expert_load is not None:  # the real tokens: a graph's padding rows are not counted
            self.expert_load.begin_step(inputs.query_start_loc_cpu[-1])
        handle = StepHandle(inputs, StepResult({}, {}, {}), spec=out.spec)
        graph = self._pick_graph(inputs, fixup)
        handle.graph = "full" if graph else ("piecewise" if self._piecewise_runs(inputs) else "eager")
        if self.defers_return:
            with self.tracer.phase("forward"):
                self._forward_stage(inputs, fixup)
            handle.deferred = inputs
            return handle
        return self._after_forward(handle, self._forward(inputs, handle.result, fixup, graph))

    @torch.inference_mode()
    def complete(self, handle: "StepHandle") -> None:
        """Pipeline parallelism with batches in flight: a step stage 0 launched earlier gets its
        scored rows back from the last stage, its LM head and its samples (or, with constrained
        rows, its logits kept for the engine's bitmask, as launch would). No-op otherwise."""
        inputs, handle.deferred = handle.deferred, None
        if inputs is None:
            return
        if self.step_channel is not None and self.tp.size > 1:
            self.step_channel.send_finish()  # stage 0's other TP ranks run the LM head with this one
        logits = self._score(self._receive_final(inputs), inputs, handle.result)
        self._after_forward(handle, logits)

    def _forward_stage(self, inputs: "StepInputs", fixup) -> None:
        """Stage 0's layers of a step, sent on to stage 1 (distributed/pipeline.py)."""
        input_ids, positions, meta = self.to_device(inputs)
        if fixup is not None:
            input_ids[fixup[0]] = fixup[1]
        self.stage.forward(self.model, input_ids, positions, self.kv_caches, meta, self._scored_rows(inputs),
                           self.dtype)

    def _receive_final(self, inputs: "StepInputs") -> torch.Tensor:
        return self.stage.receive_final(inputs.host.input_ids.shape[0], self._scored_rows(inputs),
                                        self.model_config.hidden_size, self.dtype, self.device)

    @staticmethod
    def _scored_rows(inputs: "StepInputs") -> list[int]:
        from rooflm.distributed.pipeline import scored_rows
        return scored_rows(inputs.logits_indices, [(base, count) for _, base, _, count in inputs.prompt_logprob_spans])

    def _after_forward(self, handle: "StepHandle", logits: Optional[torch.Tensor]) -> "StepHandle":
        """A launched step's sampling, once its logits exist (launch, or complete)."""
        inputs = handle.inputs
        if inputs.rows:
            meta = self._sampling_metadata(inputs.rows)
            handle.row_of = {sch.seq.seq_id: r for r, sch in enumerate(inputs.row_owner)}
            handle.constrained_rows = [r for r, row in enumerate(inputs.rows)
                                       if row.params.structured_outputs is not None]
            if handle.constrained_rows:
                # The bitmask needs the grammar matchers to have seen the previous step's
                # tokens, which with async scheduling are still on the device: the forward
                # is queued now, sampling once the engine has filled the mask.
                handle.logits, handle.meta = logits, meta
                return handle
            with self.tracer.phase("sample"):
                self._sample(handle, logits, meta)
            self._copy_results_to_host(handle)
        elif self.device.type == "cuda":
            # Nothing sampled (a prefill chunk that does not end its prompt): no results to wait
            # for, but an event all the same, so that collect(wait_device=True) can time it.
            handle.ready = torch.cuda.Event()
            handle.ready.record()
        return handle

    def _sampling_metadata(self, rows: list[SamplingRow]) -> SamplingMetadata:
        """SamplingMetadata.build, or the previous step's metadata when every row has the same
        params, generator and suppressed ids as the row in its place then (a steady decode
        batch): the metadata is a function of those alone, unless it holds token counts
        (penalties, from the histories) or a grammar's bitmask (set on it after the build), and
        such metadata is never kept. Saves the per-row Python of the build and its host-to-device
        copies on most steps at a large batch. With batches in flight (pipeline parallelism) the
        step before is another batch's: each batch's last metadata is kept."""
        for prev_rows, prev in self._meta_caches:
            if len(rows) == len(prev_rows) and all(
                    a.params is b.params and a.generator is b.generator and a.suppress_token_ids == b.suppress_token_ids
                    for a, b in zip(rows, prev_rows)):
                return prev
        meta = SamplingMetadata.build(rows, self.model_config.vocab_size, self.device)
        reusable = (meta.seen_mask is None and meta.output_counts is None
                    and all(row.params.structured_outputs is None for row in rows))
        if reusable:
            self._meta_caches.append((rows, meta))
        else:
            self._meta_caches.clear()
        return meta

    def _sample(self, handle: "StepHandle", logits: torch.Tensor, meta: SamplingMetadata) -> None:
        """Sample every row, or verify the drafts of speculating sequences (layers/rejection.py)."""
        inputs = handle.inputs
        if inputs.spec_rows:
            handle.sampled, handle.num_accepted = verify(
                self.sampler, logits, meta, inputs.spec_rows, inputs.row_owner, handle.spec)
        else:
            handle.sampled = self.sampler(logits, meta)
        if self.tp.size > 1:
            # The workers fill next step's pending input ids from these, as rank 0 does.
            self.tp.broadcast_device(handle.sampled.sampled_token_ids)

    def _send_step(self, out: SchedulerOutput, inputs: "StepInputs", prev: Optional["StepHandle"]) -> None:
        """This step's inputs to the other ranks of the tensor-parallel group."""
        from rooflm.distributed.step_broadcast import StepPacket

        h = inputs.host
        pending_rows = [prev.row_of[sid] for _, sid in inputs.pending_positions] if prev else []
        self.step_channel.send(StepPacket(
            input_ids=h.input_ids, positions=h.positions, slot_mapping=h.slot_mapping,
            query_start_loc=h.query_start_loc, seq_lens=h.seq_lens, block_tables=h.block_tables,
            logits_indices=inputs.logits_indices, max_query_len=inputs.max_query_len,
            num_decodes=inputs.num_decodes, pending_positions=[p for p, _ in inputs.pending_positions],
            pending_rows=pending_rows,
            prompt_logprob_spans=[(base, count) for _, base, _, count in inputs.prompt_logprob_spans],
            blocks_to_swap_out=list(out.blocks_to_swap_out), blocks_to_swap_in=list(out.blocks_to_swap_in),
            blocks_to_copy=list(out.blocks_to_copy), **self._lora_packet()))

    def _lora_packet(self) -> dict:
        """The step's adapter slots and slot writes, for the workers (none without LoRA)."""
        if self.lora is None:
            return {}
        slots = self.lora_mapping.host_token_slots
        return dict(lora_token_slots=[] if slots is None else slots.tolist(),
                    lora_writes=[(slot, r.lora_int_id, r.lora_name, r.lora_path) for slot, r in self.lora.step_writes])

    @torch.inference_mode()
    def sample_constrained(self, handle: "StepHandle", bitmask: torch.Tensor) -> None:
        """Sample a launched step whose rows include constrained ones, under a host bitmask
        ([rows, ceil(V / 32)] int32, all ones on unconstrained rows)."""
        meta, logits = handle.meta, handle.logits
        handle.logits = handle.meta = None
        with self.tracer.phase("sample"):
            meta.token_bitmask = self._pin(bitmask).to(self.device, non_blocking=True)
            self._sample(handle, logits, meta)
        self._copy_results_to_host(handle)

    def _copy_results_to_host(self, handle: "StepHandle") -> None:
        """Queue the device-to-host copies of a step's samples now, behind its sampling.

        Reading a device tensor (.tolist()) synchronises the whole stream, which with async
        scheduling already holds the next step: the host would wait for step t+1 to read
        step t. Copies into pinned memory plus an event wait for step t alone."""
        s = handle.sampled
        tensors = (s.sampled_token_ids, s.logprob_token_ids, s.logprobs, s.ranks, handle.num_accepted)
        if self.device.type != "cuda":
            handle.host_sampled = tensors
            return
        handle.host_sampled = tuple(
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors)
        handle.ready = torch.cuda.Event()
        handle.ready.record()

    def _pending_fixup(self, inputs: "StepInputs", prev: Optional["StepHandle"]):
        if not inputs.pending_positions:
            return None
        if prev is None or prev.sampled is None:
            raise RuntimeError("a step has pending tokens but no previous step sampled them")
        positions = [p for p, _ in inputs.pending_positions]
        rows = [prev.row_of[sid] for _, sid in inputs.pending_positions]
        dst = self._host(positions, torch.int64).to(self.device, non_blocking=True)
        src = self._host(rows, torch.int64).to(self.device, non_blocking=True)
        return dst, prev.sampled.sampled_token_ids.index_select(0, src)

    @torch.inference_mode()
    def collect(self, handle: "StepHandle", wait_device: bool = False) -> StepResult:
        """Wait for a launched step and bring its sampled tokens (and logprobs) to the host. A
        step that sampled nothing is waited for only with wait_device (async scheduling, where the
        next step is already queued: the wait costs the device nothing and the step's time is
        then its own, not carried by the next step's)."""
        if handle.deferred is not None:  # a pipeline step whose rows have not come back yet
            self.complete(handle)
        result, inputs = handle.result, handle.inputs
        if handle.sampled is None:
            if wait_device and handle.ready is not None:
                handle.ready.synchronize()
            return result
        if handle.ready is not None:
            handle.ready.synchronize()  # the step's one wait for the device
        ids, lp_ids, lp_vals, ranks, accepted = handle.host_sampled
        token_ids = ids.tolist()
        want_lp = lp_ids is not None
        if want_lp:
            lp_ids, lp_vals, ranks = lp_ids.tolist(), lp_vals.tolist(), ranks.tolist()
        sampled = result.sampled
        for r, sch in enumerate(inputs.row_owner):
            sid = sch.seq.seq_id
            tokens = sampled.get(sid)
            if tokens is None:  # most sequences have one row: no list made just to be dropped
                sampled[sid] = [token_ids[r]]
            else:
                tokens.append(token_ids[r])
            if want_lp and sch.request.params.logprobs is not None:
                k = sch.request.params.logprobs
                entry = {lp_ids[r][0]: (lp_vals[r][0], ranks[r])}
                for j in range(1, 1 + k):
                    entry.setdefault(lp_ids[r][j], (lp_vals[r][j], j))
                result.logprobs.setdefault(sid, []).append(entry)
        if accepted is not None:
            # A verifying sequence's rows hold its accepted drafts, then the token after them.
            for (row, _), a in zip(inputs.spec_rows, accepted.tolist()):
                sid = inputs.row_owner[row].seq.seq_id
                result.sampled[sid] = result.sampled[sid][:a + 1]
                if sid in result.logprobs:
                    result.logprobs[sid] = result.logprobs[sid][:a + 1]
        return result

    @torch.inference_mode()
    def forward_logits(self, input_ids: list[int], positions: list[int], slots: list[int],
                       query_lens: list[int], tables: list[list[int]], logits_indices: list[int],
                       fixup=None) -> torch.Tensor:
        """Logits at logits_indices of a packed batch described by host lists, for a companion
        model's forwards (speculative decoding's draft model): sequences with one query token
        first; query_lens[s] tokens of sequence s end at position positions[last of s]. Runs
        the decode graph, the piecewise graphs or eagerly, like a step."""
        query_start = [0]
        seq_lens = []
        for n in query_lens:
            query_start.append(query_start[-1] + n)
            seq_lens.append(positions[query_start[-1] - 1] + 1)
        host = HostInputs(
            input_ids=self._host(input_ids, torch.int64), positions=self._host(positions, torch.int64),
            slot_mapping=self._host(slots, torch.int64), query_start_loc=self._host(query_start, torch.int32),
            seq_lens=self._host(seq_lens, torch.int32),
            block_tables=self._pin(torch.from_numpy(block_table_array(tables))))
        inputs = StepInputs(host=host, query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens,
                            max_query_len=max(query_lens), num_decodes=sum(1 for n in query_lens if n == 1),
                            order=[], logits_indices=logits_indices, rows=[], row_owner=[],
                            prompt_logprob_spans=[], pending_positions=[])
        return self._forward(inputs, StepResult({}, {}, {}), fixup, self._pick_graph(inputs, fixup))

    def logits_of(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward and LM head over device tensors, every row: a caller that builds
        its own inputs on the device and may capture the call in a CUDA graph (spec/loop.py).
        Its requests run without LoRA adapters (spec.loop.loop_sampling keeps those on the host
        path), so the last host step's adapter map must not apply."""
        if self.lora_mapping is not None:
            self.lora_mapping.clear()
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def _pick_graph(self, inputs: StepInputs, fixup=None) -> Optional[tuple[int, int]]:
        """The whole-step CUDA graph that runs this step, as (tokens per sequence, graph batch),
        or None. Width 1: plain decode steps of a captured batch size or less. Wider: steps of
        few tokens per sequence (speculative verify forwards, short catch-ups) through the
        uniform graphs, padded to the narrowest width that holds them."""
        num_seqs = len(inputs.seq_lens_cpu)
        if inputs.prompt_logprob_spans:
            return None
        if self.graphs is not None and inputs.num_decodes == num_seqs:
            size = self.graphs.graph_size(num_seqs)
            return None if size is None else (1, size)
        if self.uniform_graphs is not None and fixup is None and not self._lora_active():
            # The verify graphs are captured without adapters: a verify step under one runs
            # the piecewise or eager path, its SGMV segments sized per step.
            return self.uniform_graphs.pick(inputs.max_query_len, inputs.seq_lens_cpu)
        return None

    def _piecewise_runs(self, inputs: StepInputs) -> bool:
        # A step with adapters runs eagerly: its SGMV segments and grids are sized per step on
        # the host, which the pieces (captured without adapters) cannot replay.
        return (self.piecewise is not None and not inputs.prompt_logprob_spans
                and inputs.host.input_ids.shape[0] <= self.piecewise.max_tokens
                and not self._lora_active())

    def _lora_active(self) -> bool:
        """Whether some token of the step being run is under a LoRA adapter."""
        return self.lora_mapping is not None and self.lora_mapping.active

    def _lora_graph_slots(self) -> Optional[torch.Tensor]:
        """The decode step's per-row adapter slots (on the device, set by _set_lora_mapping) for
        the graph's static buffer, or None: no row of the step has an adapter."""
        return self.lora_mapping.token_slots if self._lora_active() else None

    def _forward(self, inputs: StepInputs, result: StepResult, fixup=None,
                 graph: Optional[tuple[int, int]] = None, gather: bool = True) -> Optional[torch.Tensor]:
        """Logits of the sampling rows: from a whole-step CUDA graph where _pick_graph found one
        (graph), else through the piecewise graphs or eagerly.
        fixup = (token indices, token ids) on the device overwrites pending input ids.
        gather=False (a tensor-parallel worker, which never samples): a graph's logits stay in
        its buffer, uncopied ([rows, vocab] fp32 a step, 148 MB at 288 rows of a 128k vocabulary)."""
        h = inputs.host
        if graph is not None:
            with self.tracer.phase("graph"):
                if graph[0] == 1:
                    logits = self.graphs.run(h.input_ids, h.positions, h.slot_mapping, h.seq_lens,
                                             h.block_tables, fixup, groups=h.groups,
                                             lora_slots=self._lora_graph_slots())
                    indices = inputs.logits_indices
                else:
                    logits, rows = self.uniform_graphs.run(graph, h.input_ids, h.positions, h.slot_mapping,
                                                           h.seq_lens, h.block_tables, inputs.query_start_loc_cpu)
                    indices = rows[inputs.logits_indices].tolist()
            if not indices or not gather:
                return None
            if graph[0] == 1 and indices == list(range(len(indices))) and not any(
                    row.params.structured_outputs is not None for row in inputs.rows):
                # Every row samples once, in order: the graph's own buffer, not a [rows, vocab]
                # fp32 copy (148 MB at 288 rows of a 128k vocabulary, a new allocation each step).
                # The sampler reads it before the next replay (same stream); constrained rows
                # sample later, after the engine fills their mask, so they keep the copy.
                return logits[:len(indices)]
            idx = self._host(indices, torch.int64).to(self.device, non_blocking=True)
            return logits.index_select(0, idx)
        with self.tracer.phase("to_device"):
            input_ids, positions, meta = self.to_device(inputs)
        if self._piecewise_runs(inputs):
            with self.tracer.phase("graph"):
                hidden = self.piecewise.run(h.input_ids, h.positions, h.slot_mapping, meta, fixup,
                                            group_slots=[slots for slots, _ in h.groups])
        else:
            if fixup is not None:
                input_ids[fixup[0]] = fixup[1]
            with self.tracer.phase("forward"):
                hidden = self._model_forward(input_ids, positions, meta, inputs)
            if hidden is None:  # a pipeline stage after the first: stage 0 scores the rows
                return None
        return self._score(hidden, inputs, result)

    def _score(self, hidden: torch.Tensor, inputs: StepInputs, result: StepResult) -> Optional[torch.Tensor]:
        """The prompt logprobs and the logits of the sampling rows, from the final hidden states."""
        if inputs.prompt_logprob_spans:
            self._prompt_logprobs(hidden, inputs, result)
        if not inputs.logits_indices:
            return None
        # On CUDA the LM head's rows are padded to a multiple of 64 (repeats of the last row): a
        # new row count each step would give the allocator a new [rows, vocab] size each step.
        rows = inputs.logits_indices
        padded = rows + rows[-1:] * (-len(rows) % LOGITS_ROW_ALIGN) if self.device.type == "cuda" else rows
        idx = self._host(padded, torch.int64).to(self.device, non_blocking=True)
        with self.tracer.phase("lm_head"):
            return self.model.compute_logits(hidden.index_select(0, idx))[:len(rows)]

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       inputs: StepInputs) -> Optional[torch.Tensor]:
        """The final hidden states of the step's tokens; with pipeline parallelism this stage's
        part (distributed/pipeline.py): stage 0 gets the scored rows back, the others None."""
        if self.stage is None:
            return self.model(input_ids, positions, self.kv_caches, meta)
        return self.stage.run(self.model, input_ids, positions, self.kv_caches, meta, self._scored_rows(inputs),
                              self.dtype)

    def capture_graphs(self) -> None:
        """CUDA graphs for decode, unless on CPU or --enforce-eager."""
        if self.device.type != "cuda" or self.config.runtime.enforce_eager:
            return
        if self.stage is not None:
            # A captured step would need its point-to-point transfers captured with it.
            logger.info("CUDA graphs off, every step eager: pipeline parallelism (not captured yet)")
            return
        if self.model.graph_unsafe_reason is not None:
            logger.info("CUDA graphs off, every step eager: %s", self.model.graph_unsafe_reason)
            return
        from rooflm.engine.cuda_graph import CUDAGraphRunner
        max_batch = self._graph_max_batch()
        self.graphs = CUDAGraphRunner(self.model, self.kv_caches, self.backend, max_batch,
                                      self.max_model_len, self.block_size, self.device,
                                      lora_mapping=self.lora_mapping)
        self.timings["capture_s"] = self.graphs.capture()
        spec = self.config.speculative
        if spec.speculative_method and self.backend.name == "triton" and self.tp.size == 1:
            from rooflm.engine.cuda_graph import UniformGraphRunner
            self.uniform_graphs = UniformGraphRunner(
                self.model, self.kv_caches, spec.num_speculative_tokens + 1,
                spec.speculative_max_batch_tokens or 256, max_batch, self.max_model_len, self.block_size,
                self.device, pool=self.graphs.pool)
            self.timings["uniform_capture_s"] = self.uniform_graphs.capture()
        if self.config.runtime.piecewise_cuda_graphs and self.backend.name == "triton":
            from rooflm.engine.piecewise_graph import PiecewiseGraphRunner
            self.piecewise = PiecewiseGraphRunner(self.model, self.kv_caches, self.backend,
                                                  self.config.scheduler.max_num_batched_tokens, self.device)
            self.timings["piecewise_capture_s"] = self.piecewise.capture()
        self._graph_addresses = tensor_addresses(self.model, self.kv_caches)

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs and their memory pool, once the device has run them.
        Tensor parallelism calls it on every rank before the process group is destroyed: NCCL's
        destroy_process_group waits for graphs that captured its collectives to go first, and
        hung on the H200x2 run when they were still alive. Later steps run eagerly."""
        if self.step_channel is not None:
            self.step_channel.flush()  # the last step's packet has reached the workers
        if self.graphs is None and self.piecewise is None and self.uniform_graphs is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay may still be running
        for runner in (self.graphs, self.piecewise, self.uniform_graphs):
            if runner is not None:
                runner.release()
        self.graphs = None
        self.piecewise = None
        self.uniform_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- sleep mode (LLMEngine.sleep) ----------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Give the device back. The KV pool always; the weights moved into pinned host memory
        (level 1; on the CPU they are there already: kept) or dropped (level 2). On regions
        (sleep_memory.py) the physical memory is unmapped and the addresses stay reserved, so
        the CUDA graphs are kept through level 1; without regions, or at level 2 (new weights
        will be loaded at new addresses), the graphs go too. The host swap pool stays: it is
        host memory."""
        self._offloads_done = None  # the device is synchronised below: nothing left to wait for
        self._slept_num_blocks = self.kv_cache.shape[2]
        self._meta_caches.clear()
        if self.kv_region is None or level == 2:
            self.release_graphs()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no step or replay still reads what goes below
        if self.kv_region is not None:
            self.kv_region.unmap_all()  # the tensors on it stay, unbacked until wake_up
        else:
            self.kv_cache = self.kv_caches = self.kv_scales = None
        if level == 2:
            self.model = None
            if self.weights_region is not None:
                self.weights_region.close()
                self.weights_region = None
        elif self.weights_region is not None:
            self._weights_host = host_backup(self.weights_region.nbytes, self.device)
            self._weights_host.copy_(self.weights_region.data)
            self.weights_region.unmap_all()
        elif self.device.type != "cpu":
            self.model._apply(_to_pinned_host)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def wake_up(self, path: str, load_format: str) -> WakePhases:
        """The weights back on the device (level 2: loaded again from path), the KV pool back
        (zeroed, same size), the CUDA graphs kept when every address they captured is
        unchanged, else captured again. Returns where the time went."""
        t0 = time.perf_counter()
        weights = self._wake_weights(path, load_format)
        self._sync()
        t1 = time.perf_counter()
        if self.kv_region is not None:
            self.kv_region.map_all()
            self.kv_cache.zero_()  # as allocate_kv_cache: finite values before any read
            if self.kv_scale_mode() == "per-token":
                self.kv_scales.zero_()
        else:
            self.allocate_kv_cache(self._slept_num_blocks, quiet=True)
        self._sync()
        t2 = time.perf_counter()
        graphs = self._revalidate_graphs()
        self._sync()
        self._weights_host = None  # its copy has landed (synchronised above)
        t3 = time.perf_counter()
        return WakePhases(t1 - t0, t2 - t1, t3 - t2, t3 - t0, graphs, weights)

    def _wake_weights(self, path: str, load_format: str) -> str:
        if self.model is None:
            self.load_model(path, load_format)
            return "loaded"
        if self.weights_region is not None:
            self.weights_region.map_all()
            # One copy from one pinned buffer; waited for once, with the pool's zeroing.
            self.weights_region.data.copy_(self._weights_host, non_blocking=True)
            return "copied"
        if self.device.type != "cpu":
            self.model._apply(lambda t: t.to(self.device, non_blocking=True))
            return "copied"
        return "kept"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _revalidate_graphs(self) -> str:
        """"kept" when graphs exist and every address they captured is where it was (a replay
        on a moved tensor would read freed memory: then they are captured again, and the log
        names what moved); "captured" when captured (again); "none" when steps run eagerly."""
        if self.graphs is not None or self.piecewise is not None or self.uniform_graphs is not None:
            moved = stale_addresses(self._graph_addresses, tensor_addresses(self.model, self.kv_caches))
            if not moved:
                return "kept"
            logger.warning("wake_up: %d captured addresses moved (%s%s): capturing the CUDA graphs again",
                           len(moved), ", ".join(moved[:4]), ", ..." if len(moved) > 4 else "")
            self.release_graphs()
        self.capture_graphs()
        return "none" if self.graphs is None and self.piecewise is None else "captured"

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs, result: StepResult) -> None:
        for sch, base, first, count in inputs.prompt_logprob_spans:
            seq = sch.seq
            logits = self.model.compute_logits(hidden[base:base + count])
            targets = torch.tensor(seq.token_ids[first + 1:first + 1 + count], device=self.device)
            k = sch.request.params.prompt_logprobs
            ids, vals, ranks = compute_logprobs(logits, targets, k)
            ids, vals, ranks = ids.tolist(), vals.tolist(), ranks.tolist()
            entries = []
            for i in range(count):
                entry = {ids[i][0]: (vals[i][0], ranks[i])}
                for j in range(1, 1 + k):
                    entry.setdefault(ids[i][j], (vals[i][j], j))
                entries.append(entry)
            result.prompt_logprobs[seq.seq_id] = entries
