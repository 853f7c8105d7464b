"""The served LoRA adapters: names the OpenAI `model` field may give, each a LoRARequest.

The registry lives in the API process. A request naming an adapter carries its LoRARequest
(name, id, path) to the engine, which reads the adapter into its host cache on first use; so
--lora-modules at start-up and POST /v1/load_lora_adapter at run time only check the directory
here (adapter_config.json: present, LoRA, served targets, rank <= --max-lora-rank) and give the
adapter a fresh id. A name loaded again gets a new id, so it never reuses the old adapter's
prefix-cache blocks.
"""

from __future__ import annotations

import itertools
from typing import Optional

from rooflm.config import LoRAConfig
from rooflm.lora.adapter import LoRAAdapterError, read_adapter_config
from rooflm.lora.request import LoRARequest
from rooflm.server.protocol import RequestError


def parse_lora_modules(specs: tuple[str, ...]) -> list[tuple[str, str]]:
    """--lora-modules name=path ... -> [(name, path)]."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
        pairs.append((name, path))
    return pairs


class LoRARegistry:
    def __init__(self, config: Optional[LoRAConfig], base_name: str):
        self.config = config  # None: the engine runs without --enable-lora
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.enable_lora

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and register an adapter; RequestError (400, or 404 for a path with nothing
        there) naming the problem."""
        if not self.enabled:
            raise RequestError(f"LoRA adapter {name!r}: the server runs without --enable-lora",
                               param="lora_name")
        if name == self.base_name or name in self.adapters:
            raise RequestError(f"The lora adapter {name!r} has already been loaded (or names the "
                               f"base model)", param="lora_name")
        try:
            read_adapter_config(path, self.config.max_lora_rank)
        except LoRAAdapterError as e:
            raise RequestError(str(e), param="lora_path", status=e.status) from e
        request = LoRARequest(name, next(self._ids), path)
        self.adapters[name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        request = self.adapters.pop(name, None)
        if request is None:
            raise RequestError(f"The lora adapter {name!r} cannot be found", param="lora_name",
                               status=404, code="model_not_found")
        return request

    def get(self, name: str) -> Optional[LoRARequest]:
        return self.adapters.get(name)
