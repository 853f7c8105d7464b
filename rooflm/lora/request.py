"""The adapter a request runs under: vLLM's LoRARequest (name, integer id, path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what clients call it (the OpenAI `model` field); lora_int_id: its identity,
    > 0 (the server gives each load a new one, so a reloaded name never reuses old K/V);
    lora_path: the PEFT directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")

    @property
    def prefix_key(self) -> str:
        """What the prefix cache's block hashes take in: the same prompt under two adapters (or
        two loads of one name) must never share K/V."""
        return f"{self.lora_int_id}\x00{self.lora_name}\x00{self.lora_path}"
