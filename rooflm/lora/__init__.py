"""Multi-LoRA serving: one base model, many adapters in one batch (docs/lora.md).

- request.py: LoRARequest (vLLM's), the adapter a request runs under.
- adapter.py: a PEFT adapter directory read and checked against the base model's shapes.
- mapping.py: the step's token -> slot map, rewritten once per step by the model runner.
- hook.py: the per-linear hook, y = base(x) + (x @ A_slot^T) @ B_slot^T per shard, and its
  installation on a decoder's targeted linears.
- manager.py: the device slot pool (--max-loras) behind an LRU host cache (--max-cpu-loras).
"""

from rooflm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
