"""The engine's read-only face: what it is, where it stands, and what each step did.

Servers, benchmarks, the metrics path and the profiler read only these; none of
them reaches into the scheduler, the block manager or the runner.

- EngineInfo: fixed at start-up (model shape, device, KV pool size). Plain values
  only, so it can cross a process boundary as it is.
- EngineSnapshot: the queues and the KV pool now (`LLMEngine.snapshot()`).
- StepReport: one executed step, delivered to observers (`LLMEngine.add_observer`):
  what ran (sequences and tokens by kind, the batch's shape for the cost model),
  whether a CUDA graph ran it, and host timings by phase.
- ExpertLoad: tokens routed to each expert of each MoE layer over recent steps
  (`LLMEngine.expert_load()`, with count_expert_load on).
- PhaseTracer: the hook the profiler uses to put named ranges around the
  phases of a step. The default does nothing; the engine never imports perf/.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from rooflm.config import ModelConfig

if TYPE_CHECKING:
    from rooflm.engine.scheduler import SchedulerOutput

_NO_WINDOW = 1 << 62  # a context length no sequence reaches


@dataclass(frozen=True)
class EngineInfo:
    model: str  # what the user asked for (path, preset name or "default")
    model_config: ModelConfig
    max_model_len: int
    block_size: int
    num_blocks: int  # device KV pool
    num_host_blocks: int  # swap space
    max_num_seqs: int
    max_num_batched_tokens: int
    device: str  # "cuda:0", "cpu"
    dtype: str  # torch dtype name without "torch.": "bfloat16", "float32"
    # Bytes per weight of the layers' linear weights as stored: quantized blocks with their
    # scales count what they hold (0.625 for Q4_1 as packed int4), not the dtype.
    weight_dtype_bytes: float
    kv_dtype_bytes: float
    async_scheduling: bool
    has_tokenizer: bool
    startup_s: float
    act_dtype_bytes: float = 0.0  # bytes per activation element; 0: as weight_dtype_bytes
    head_dtype_bytes: float = 0.0  # bytes per LM head weight as stored; 0: step_cost's default
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (E4M3 + per-head scales)
    tensor_parallel_size: int = 1  # ranks the model is split over (each holds 1/N, its own KV pool)
    # Tensor-core format the linear layers multiply in, where it is not the activations' dtype:
    # "fp8" for W8A8 (its roof is the fp8 rate, 2x bf16 on an H100); "" otherwise.
    matmul_dtype: str = ""
    enable_sleep_mode: bool = False  # the engine may sleep (LLMEngine.sleep, the server's /sleep)
    num_offload_blocks: int = 0  # the prefix cache's host tier (--kv-offload-gb), blocks of block_size

    @property
    def offload_capacity_tokens(self) -> int:
        return self.num_offload_blocks * self.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]


@dataclass(frozen=True)
class SpecSnapshot:
    """Speculative decoding since start (vLLM's spec_decode counters)."""

    num_drafts: int  # verify steps of a sequence with at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # accepted drafts at each draft position
    draft_s: float  # host seconds proposing (a draft model's forwards included)
    verify_s: float  # seconds of steps that verified drafts, launch to results

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step of a sequence: accepted drafts plus the one after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class LoRASnapshot:
    """--enable-lora: the adapters of the queues now, and requests per adapter since start
    (vLLM's vllm:lora_requests_info and rooflm's per-adapter counts). Adapters by name,
    (name, count) pairs sorted by name."""

    max_loras: int
    running: tuple[tuple[str, int], ...] = ()
    waiting: tuple[tuple[str, int], ...] = ()
    requests: tuple[tuple[str, int], ...] = ()  # admitted since start


def merge_lora_snapshots(snaps: list["LoRASnapshot"]) -> Optional["LoRASnapshot"]:
    """Data-parallel replicas' LoRA snapshots as one: counts summed per adapter."""
    if not snaps:
        return None

    def merged(part: str) -> tuple[tuple[str, int], ...]:
        counts: dict[str, int] = {}
        for snap in snaps:
            for name, n in getattr(snap, part):
                counts[name] = counts.get(name, 0) + n
        return tuple(sorted(counts.items()))

    return LoRASnapshot(max(s.max_loras for s in snaps), merged("running"), merged("waiting"), merged("requests"))


@dataclass(frozen=True)
class EngineSnapshot:
    num_running_reqs: int
    num_waiting_reqs: int  # waiting for admission, preempted-by-recompute included
    num_swapped_reqs: int
    num_running_seqs: int
    num_free_blocks: int
    num_blocks: int
    running_context_tokens: int  # K/V tokens the running sequences hold
    num_preemptions: int  # since start
    prefix_queried_tokens: int  # since start: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of which found
    prompt_tokens: int  # since start
    generation_tokens: int
    steps: int
    # Since start: steps whose admission stopped because the KV pool (less the room kept for
    # the running requests' growth) could not take the next waiting request.
    kv_admission_stalls: int = 0
    spec: Optional[SpecSnapshot] = None  # None without speculative decoding
    # Seconds a default request arriving now is predicted to wait before its first step
    # (engine/step_cost.py): the gauge an autoscaler scales on.
    predicted_wait_s: float = 0.0
    is_sleeping: bool = False  # sleep mode: the KV pool is freed, the weights moved or dropped
    # The prefix cache's host tier (engine/host_kv_tier.py): of prefix_hit_tokens, those whose
    # blocks came back from host memory; its blocks in use, and copied in and back since start.
    prefix_host_hit_tokens: int = 0
    num_offload_used_blocks: int = 0
    num_offloaded_blocks: int = 0
    num_restored_blocks: int = 0
    lora: Optional[LoRASnapshot] = None  # None without --enable-lora

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens routed to each expert over the last `len(counts)` steps the engine began:
    counts[step][layer][expert], oldest step first; layers names the MoE blocks (module names).
    Under expert parallelism rank r holds experts [r E/ep_ranks, (r+1) E/ep_ranks)."""

    layers: tuple[str, ...]
    num_experts: int
    top_k: int
    ep_ranks: int  # 1 without expert parallelism
    steps_begun: int  # since start
    counts: tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True)
class BatchShape:
    """A batch as the step-cost model (perf/roofline.step_cost) reads it.

    A decode row is one new token that completes the K/V and is sampled; it
    attends to its whole context. Anything else is a prefill chunk, which may
    start after cached tokens (an earlier chunk or a prefix hit) and is sampled
    when it ends the prompt (n times for a prompt that forks into n samples).
    """

    num_decode_seqs: int = 0
    decode_context_tokens: int = 0
    prefill_tokens: int = 0
    prefill_attention_pairs: int = 0  # (query, key) pairs under the causal mask
    prefill_context_tokens: int = 0  # K/V tokens the prefill chunks read (cached + new)
    num_sampled_prefills: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_decode_seqs + self.prefill_tokens

    @property
    def num_sampled(self) -> int:
        return self.num_decode_seqs + self.num_sampled_prefills

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.num_decode_seqs:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"

    def as_kwargs(self) -> dict[str, int]:
        return dict(num_decode_seqs=self.num_decode_seqs, decode_context_tokens=self.decode_context_tokens,
                    prefill_tokens=self.prefill_tokens, prefill_attention_pairs=self.prefill_attention_pairs,
                    prefill_context_tokens=self.prefill_context_tokens,
                    num_sampled_prefills=self.num_sampled_prefills)


def batch_shape(out: "SchedulerOutput", sliding_window: Optional[int] = None) -> BatchShape:
    """The BatchShape of a scheduled batch. It reads each chunk's `start`, fixed at
    scheduling, so it is right before and after the counters move. Runs every step:
    one pass with plain attribute reads (tens of microseconds at 256 sequences)."""
    cap = sliding_window if sliding_window is not None else _NO_WINDOW
    num_decode = decode_ctx = 0
    prefill_tokens = prefill_pairs = prefill_ctx = sampled_prefills = 0
    for sch in out.scheduled:
        n = sch.num_new_tokens
        end = sch.start + n
        if n == 1 and sch.completes and (end != sch.seq.num_prompt_tokens or not sch.request.needs_fork):
            # A decode row; also the prompt's last token computed on its own (decode-shaped),
            # unless the prompt forks into n samples (then it is n sampled rows).
            num_decode += 1
            decode_ctx += end if end < cap else cap
            continue
        start = sch.start
        prefill_tokens += n
        prefill_ctx += (start if start < cap else cap) + n
        k = min(max(cap - start, 0), n)  # new tokens that see fewer than `cap` positions
        prefill_pairs += k * start + k * (k + 1) // 2 + (n - k) * cap
        if sch.completes:
            sampled_prefills += sch.request.params.n if sch.request.needs_fork else 1
    return BatchShape(num_decode, decode_ctx, prefill_tokens, prefill_pairs, prefill_ctx, sampled_prefills)


@dataclass(frozen=True)
class StepTimings:
    """Host seconds by phase of one step (perf_counter). With async scheduling the step
    was launched during the previous call of step() and collected in this one."""

    schedule_s: float = 0.0
    launch_s: float = 0.0  # block ops, input building, enqueueing the forward and sampler
    wait_s: float = 0.0  # blocked on the device for the step's sampled tokens
    process_s: float = 0.0  # appending tokens, detokenizing, stop checks, outputs
    elapsed_s: float = 0.0  # the step's wall time: launch to results (sync), or between results (async)


@dataclass(frozen=True)
class StepReport:
    step: int  # 1-based index of the step since start
    shape: BatchShape
    num_seqs: int
    num_preempted: int  # requests preempted while scheduling this step
    graph: str  # how the forward ran: "full" (one CUDA graph), "piecewise" (graphs between
    # eager attention calls) or "eager"
    timings: StepTimings

    @property
    def kind(self) -> str:
        return self.shape.kind


class PhaseTracer:
    """Names the phases of a step. The default costs one call per phase and records
    nothing; the profiler passes one that opens profiler ranges."""

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


NULL_TRACER = PhaseTracer()
