"""A PEFT LoRA adapter directory, read and checked against the base model before it serves.

PEFT saves adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors with, per adapted projection, lora_A [r, in] and lora_B [out, r]
under the base model's module names ("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight").
The adapted layer computes W x + scaling * B A x, scaling = lora_alpha / r, or lora_alpha / sqrt(r)
with rsLoRA.

Every refusal is a LoRAAdapterError naming the directory and the problem; `status` is what an
HTTP front end answers (404: nothing there, 400: there but unusable).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from rooflm.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's target names -> (the fused linear of rooflm's decoder, its shard; None: not fused).
PROJECTIONS: dict[str, tuple[str, Optional[str]]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot serve; the message names the directory and the problem."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class LoRAAdapter:
    """An adapter in host memory: weights[(layer, projection)] = (A [r, in], B [out, r])."""

    name: str
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def scaling(self) -> float:
        return self.config.scaling

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_adapter_config(path: str, max_rank: Optional[int] = None) -> AdapterConfig:
    """adapter_config.json checked for what rooflm serves: LoRA (no DoRA, no bias, no extra
    trained modules, one rank), targets among q/k/v/o/gate/up/down, rank <= max_rank."""
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} is not a directory", status=404)
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {CONFIG_FILE}", status=404)
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}", status=404)
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} does not parse ({e})") from e
    where = f"LoRA adapter {path!r}"
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {raw.get('peft_type')!r}, only LORA is served")
    if raw.get("use_dora"):
        raise LoRAAdapterError(f"{where}: DoRA (use_dora) is not served")
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: trained biases (bias={raw.get('bias')!r}) are not served")
    if raw.get("modules_to_save"):
        raise LoRAAdapterError(f"{where}: modules_to_save {raw['modules_to_save']} are not served "
                               f"(only the LoRA A/B pairs)")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise LoRAAdapterError(f"{where}: per-module rank_pattern / alpha_pattern are not served")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    targets = raw.get("target_modules") or ()
    if targets == "all-linear":
        targets = tuple(PROJECTIONS)
    elif isinstance(targets, str):  # a regex over module names: the weights say what it matched
        targets = ()
    targets = tuple(t.rsplit(".", 1)[-1] for t in targets)
    unknown = [t for t in targets if t not in PROJECTIONS]
    if unknown:
        raise LoRAAdapterError(f"{where}: target modules {unknown} are not served (one of "
                               f"{', '.join(PROJECTIONS)})")
    alpha = raw.get("lora_alpha", rank)
    return AdapterConfig(rank=rank, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
                         target_modules=targets)


def projection_shape(cfg: ModelConfig, projection: str) -> tuple[int, int]:
    """(out_features, in_features) of a projection of the whole (unsharded) model."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
            "o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[projection]


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def map_safetensors(file: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as views into one private read-ahead mapping of it, no copy:
    the slot image (rooflm/lora/manager.py) is then the only copy an adapter's bytes take on
    the host (safetensors' load_file copies every tensor out of its own mapping first, and the
    image copied them again). The format: an 8-byte little-endian header length, the header
    (JSON: name -> dtype, shape, data_offsets from the data's start), the data."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        # MAP_POPULATE: the pages are read (or found in the page cache) in one call, not faulted
        # in one by one during the copies; private and writable so torch may view it.
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        data = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    header_len = int.from_bytes(data[:8], "little")
    if 8 + header_len > size:
        raise ValueError(f"header of {header_len} bytes in a file of {size}")
    header = json.loads(bytes(data[8:8 + header_len]))
    whole = torch.frombuffer(data, dtype=torch.uint8)
    base = 8 + header_len
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {key!r} is {entry['dtype']}, not one of {', '.join(_SAFETENSORS_DTYPES)}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if base + end > size or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {key!r}'s bytes [{begin}, {end}) do not hold {shape} {entry['dtype']} "
                             f"in a file of {size} bytes")
        tensors[key] = whole[base + begin:base + end].view(dtype).view(shape)
    return tensors


def load_adapter(name: str, path: str, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter's A/B pairs, every one checked against the base model's shapes (views into
    the file's mapping: copy them where they go, as the slot image does)."""
    config = read_adapter_config(path, max_rank)
    where = f"LoRA adapter {path!r}"
    try:
        tensors = map_safetensors(os.path.join(path, WEIGHTS_FILE))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:  # a truncated or foreign file
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} does not load ({e})") from e
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                                   f"layer's q/k/v/o/gate/up/down projection")
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if proj not in PROJECTIONS:
            raise LoRAAdapterError(f"{where}: tensor {key!r} adapts {proj}, which is not served")
        if layer >= model.num_hidden_layers:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is for layer {layer}, but the base model "
                                   f"has {model.num_hidden_layers} layers")
        if proj in MLP_PROJECTIONS and model.num_experts:
            raise LoRAAdapterError(f"{where}: {proj} of a mixture-of-experts model is not served")
        pairs.setdefault((layer, proj), {})[which] = tensor
    weights = {}
    for (layer, proj), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"{where}: layer {layer} {proj} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        out_f, in_f = projection_shape(model, proj)
        if tuple(a.shape) != (config.rank, in_f) or tuple(b.shape) != (out_f, config.rank):
            raise LoRAAdapterError(
                f"{where}: layer {layer} {proj} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"the base model with rank {config.rank} needs ({config.rank}, {in_f}) and ({out_f}, {config.rank})")
        weights[(layer, proj)] = (a, b)
    if not weights:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    found = {proj for _, proj in weights}
    missing = [t for t in config.target_modules if t not in found]
    if missing:
        raise LoRAAdapterError(f"{where}: adapter_config.json targets {missing} but "
                               f"{WEIGHTS_FILE} has no weights for them")
    return LoRAAdapter(name=name, config=config, weights=weights)
