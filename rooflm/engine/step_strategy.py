"""The step plan: how LLMEngine turns its queues into launched steps.

LLMEngine._step does what every step does (the clock, a dead-worker check, grammars that failed
to compile) and hands the rest to the strategy attached to the engine, which plans the step
and runs it through the engine's step methods:

    engine.launch(out, t0)        queue a scheduled batch on the model runner
    engine.finish_now(step, outs) wait for it and process it (synchronous scheduling)
    engine.overlap(step, outs)    keep it queued and finish the step before it (async scheduling)
    engine.drain()                finish the step in flight, if any
    engine.count_step()           the index of a step launched outside the runner

Strategies:
    PlainStep                     schedule, launch, finish (below)
    PipelineStep                  pipeline parallelism: up to N batches in flight through the stages
    spec.strategy.SpecHostStep    speculative decoding on the host: draft slots before scheduling,
                                  proposals after it; a verify step runs synchronously
    spec.strategy.SpecLoopStep    speculative decoding's device loop where the batch fits it, the
                                  host path otherwise

Speculative decoding sits above the engine (it imports the engine and plugs into it), so the
engine names no speculative class: llm_engine.strategy_for asks spec's factory, lazily (the
engine's one import of spec). --deterministic is no strategy: it changes the kernels the runner
passes to the model, not the step's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from rooflm.engine.report import BatchShape, SpecSnapshot
from rooflm.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.engine.model_runner import StepResult
    from rooflm.engine.outputs import RequestOutput


@dataclass
class InFlightStep:
    """A launched step, until its results are processed."""

    out: SchedulerOutput
    handle: object  # model_runner.StepHandle, or what `collector` reads (spec.loop.LoopStep)
    shape: Optional[BatchShape]  # None: known once the step is collected (its drafts decide it)
    index: int
    schedule_s: float
    launch_s: float
    launched_at: float
    planned_at: float  # when the step's _step began (the speculation policy's clock)
    behind: bool  # launched while another step was in flight (the async pipeline was full)
    speculating: bool = False  # planned to verify drafts (the proposer may have found none)
    # What collects the step: collect(handle, wait_device) -> StepResult. None: the model runner.
    collector: object = None


class StepStrategy:
    """How each step runs. The engine calls kv_bytes_per_block() before sizing the KV pool,
    attach() once its parts exist, then step() every step and observe_result (when set) with
    every step's results."""

    # With speculative decoding: its SpecDecoder and device loop (None without), which tests
    # and benchmarks reach through LLMEngine.spec and LLMEngine.spec_loop.
    decoder: object = None
    loop: object = None
    # observe_result(step, result, collected_at): called after each step's results are read
    # back, before they are processed; None where the strategy needs no results.
    observe_result: Optional[Callable[[InFlightStep, "StepResult", float], None]] = None

    def kv_bytes_per_block(self) -> int:
        """KV bytes the strategy keeps per block of the target's pool (a draft model's)."""
        return 0

    def attach(self, engine: "LLMEngine") -> "StepStrategy":
        """Take the engine's parts; returns the strategy that runs the steps: this one, or one
        it hands over to now that the runner is ready (the device loop needs its CUDA graphs)."""
        self.engine = engine
        return self

    def step(self, t0: float, outputs: list["RequestOutput"]) -> list["RequestOutput"]:
        """Run one step begun at t0 (perf_counter); `outputs` go first in what it returns."""
        raise NotImplementedError

    def spec_snapshot(self) -> Optional[SpecSnapshot]:
        """Speculative decoding's totals for EngineSnapshot.spec (None without)."""
        return None


class PlainStep(StepStrategy):
    """Schedule, launch, finish: with async scheduling (CUDA) the step stays queued while the
    previous one is finished, so host work overlaps device work."""

    def step(self, t0: float, outputs: list["RequestOutput"]) -> list["RequestOutput"]:
        engine = self.engine
        with engine.tracer.phase("schedule"):
            out = engine.scheduler.schedule()
        launched = engine.launch(out, t0)
        if engine.async_scheduling:
            return engine.overlap(launched, outputs)
        return engine.finish_now(launched, outputs)


class PipelineStep(StepStrategy):
    """Pipeline parallelism with batches in flight (vLLM's virtual engines): each step schedules
    a batch of the requests no batch in flight holds (Scheduler.hold_pending) and launches it
    on stage 0, which runs its layers and sends them on at once; once `depth` batches are in
    flight, or nothing more can be scheduled, the oldest is finished (its rows back from the
    last stage, LM head, samples) and processed. So stage 0 runs batch B's layers while the
    later stages run batch A's, and the stages do not idle for each other."""

    def __init__(self, depth: int):
        self.depth = depth

    def attach(self, engine: "LLMEngine") -> "StepStrategy":
        engine.scheduler.use_micro_batches(self.depth)
        return super().attach(engine)

    def step(self, t0: float, outputs: list["RequestOutput"]) -> list["RequestOutput"]:
        engine = self.engine
        with engine.tracer.phase("schedule"):
            out = engine.scheduler.schedule()
        launched = engine.launch(out, t0)
        if launched is not None:
            engine.pipeline.append(launched)
        if engine.pipeline and (launched is None or len(engine.pipeline) >= self.depth):
            return outputs + engine.finish_pipelined()
        return outputs
