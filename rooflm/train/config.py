"""Every knob of a training run, in one frozen dataclass; the CLI flags map onto its fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
CHECKPOINTING = ("none", "full", "selective")
LR_SCHEDULES = ("cosine", "linear", "constant")
PARALLEL = ("none", "ddp", "fsdp")
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")


@dataclass(frozen=True)
class TrainConfig:
    # what to train, on what
    model: Optional[str] = None  # path, .gguf or preset; None = the embedded SmolLM2
    load_format: str = "auto"
    data: Optional[str] = None  # text file, or token ids (.npy, or .txt/.ids of integers)
    device: str = "auto"  # auto | cpu | cuda
    # the step
    seq_len: int = 128
    micro_batch: int = 1
    grad_accum: int = 1
    max_steps: int = 20
    # knobs
    precision: str = "fp32"
    compile: bool = False
    activation_checkpointing: str = "none"
    optimizer: str = "adamw"
    fused: bool = False
    parallel: str = "none"  # under torchrun: ddp or fsdp; none = one process
    sdpa_backend: str = "auto"  # the SDPA kernel tried first (auto: torch's own order)
    # optimizer and schedule
    lr: float = 3e-4
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0 = off
    seed: int = 0
    # checkpoints and results
    save_dir: Optional[str] = None
    save_every: int = 0  # 0 = only at the end (when save_dir is set)
    resume: Optional[str] = None  # a checkpoint directory written by save_dir
    results: Optional[str] = None  # JSON results file
    warmup_measure_steps: int = 2  # steps left out of tokens/s (compile, allocator warm-up)
    profile: bool = True  # profile one step for the breakdown
    progress: bool = True
    # compression
    teacher: Optional[str] = None  # distillation: a teacher model (same tokenizer)
    teacher_load_format: str = "auto"
    distill_alpha: float = 1.0  # weight of the KL term; 1 - alpha on the next-token loss
    distill_temperature: float = 1.0
    qat: Optional[str] = None  # fake-quant QAT of the block weights: int8 or int4 (per channel)

    def __post_init__(self) -> None:
        def one_of(name, allowed):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name.replace('_', '-')} must be one of {', '.join(allowed)}; "
                                 f"got {value!r}")

        one_of("precision", PRECISIONS)
        one_of("activation_checkpointing", CHECKPOINTING)
        one_of("lr_schedule", LR_SCHEDULES)
        one_of("parallel", PARALLEL)
        one_of("sdpa_backend", SDPA_BACKENDS)
        one_of("optimizer", ("adamw",))
        for name in ("seq_len", "micro_batch", "grad_accum", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0; got {self.lr}")
        if self.warmup_steps < 0 or self.save_every < 0 or self.warmup_measure_steps < 0:
            raise ValueError("warmup-steps, save-every and measure warm-up must be >= 0")
        if self.qat is not None and self.qat not in ("int8", "int4"):
            raise ValueError(f"qat must be int8 or int4; got {self.qat!r}")
        if not 0.0 <= self.distill_alpha <= 1.0:
            raise ValueError(f"distill-alpha must be in [0, 1]; got {self.distill_alpha}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens one process trains on per optimizer step."""
        return self.seq_len * self.micro_batch * self.grad_accum
