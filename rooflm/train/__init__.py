"""Training on the engine's own model code: `rooflm train` and `rooflm bench train`.

causal.py    the training view of a rooflm model: [B, S] tokens -> loss, plain causal SDPA
config.py    TrainConfig, one frozen dataclass for every knob
data.py      a text file or token-id file -> fixed-length windows, the same for every run
precision.py fp32 / bf16 / fp16 (loss scaling) / fp8 (torchao): autocast and scaler
parallel.py  torchrun process group, DDP and FSDP2 wrapping, gradient-sync control
checkpoint.py save / resume: HF-named safetensors plus optimizer, scheduler, scaler, RNG
measure.py   FLOPs per step, MFU, peak memory vs rooflm.perf.memory, profiler breakdown, verdict
trainer.py   the loop
bench.py     the knob sweep
commands.py  the CLI

It reuses rooflm/model and rooflm/layers (same modules, same weight loaders) and never imports
the engine.
"""
