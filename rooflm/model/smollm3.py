"""SmolLM3 (SmolLM3ForCausalLM): the Llama layer, with no RoPE on the layers config.json's
no_rope_layers marks 0 (HF's default: every no_rope_layer_interval-th, i.e. layers 3, 7, 11, ...
with the interval of 4). Where use_sliding_window is set, the layers layer_types calls
"sliding_attention" (by default the no-RoPE ones) attend within sliding_window.
Checkpoint names are Llama's.
"""

from __future__ import annotations

from typing import Any

from rooflm.config import ModelConfig
from rooflm.layers.rotary import Rope
from rooflm.model.decoder import CausalLM
from rooflm.model.gguf_layout import GGUFLayout, GGUFMetadata
from rooflm.model.spec import ModelSpec, layer_windows

ARCHITECTURE = "SmolLM3ForCausalLM"
MODEL_TYPE = "smollm3"


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json -> no_rope_layers and the windows, as HF's SmolLM3Config derives them."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"SmolLM3 with hidden_act {act!r}: rooflm runs silu")
    layers = int(raw["num_hidden_layers"])
    interval = int(raw.get("no_rope_layer_interval", 4))
    no_rope_layers = raw.get("no_rope_layers")
    if no_rope_layers is None:
        no_rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(no_rope_layers) != layers:
        raise ValueError(f"no_rope_layers has {len(no_rope_layers)} entries for {layers} layers")
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", False) or window is None:
        return dict(no_rope_layers=tuple(int(x) for x in no_rope_layers))
    layer_types = raw.get("layer_types") or ["full_attention" if use_rope else "sliding_attention"
                                             for use_rope in no_rope_layers]
    return dict(no_rope_layers=tuple(int(x) for x in no_rope_layers), sliding_window=int(window),
                layer_types=tuple(layer_types))


def spec(cfg: ModelConfig) -> ModelSpec:
    rope = Rope(cfg.rope_theta, cfg.rope_scaling)
    use_rope = cfg.no_rope_layers or (1,) * cfg.num_hidden_layers
    return ModelSpec(layer_windows=layer_windows(cfg),
                     layer_ropes=tuple(rope if use else None for use in use_rope))


class SmolLM3ForCausalLM(CausalLM):
    spec_of = staticmethod(spec)


def gguf_config(gguf: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """No metadata key says which layers skip RoPE: llama.cpp hard-codes every 4th (SmolLM3-3B's
    no_rope_layer_interval), and so does a GGUF reader. No window is written either."""
    return dict(no_rope_layers=tuple(int((i + 1) % 4 != 0) for i in range(fields["num_hidden_layers"])))


# GGUF: llama.cpp converts SmolLM3 as a Llama (q/k permuted).
GGUF = GGUFLayout("smollm3", rotary_permuted=True, config_fields=gguf_config)
