"""Architecture name (config.json "architectures"[0] or GGUF general.architecture) -> family.

A family is its config -> parts mapping (a ModelSpec, model/spec.py), the config.json fields
beyond the Llama ones it reads, and its model class: a CausalLM (model/decoder.py) subclass in
the family's own file (model/llama.py, model/olmo2.py, model/gemma2.py).
docs/adding-a-model.md walks through adding one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from rooflm.config import ModelConfig
from rooflm.model.gguf_layout import GGUFLayout
from rooflm.model import gemma2, gemma3, gpt_oss, granite, mixtral, olmo2, olmoe, phi3, qwen2_moe, qwen3_moe, smollm3
from rooflm.model.llama import LlamaForCausalLM
from rooflm.model.spec import ModelSpec, llama_spec


def no_config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    architecture: str  # HF's class name, config.json "architectures"[0]
    model_type: str  # HF's model_type, for the config.json rooflm writes (model/hf_config.py)
    spec: Callable[[ModelConfig], ModelSpec]
    # the family's CausalLM subclass (model/decoder.py)
    model_class: type = LlamaForCausalLM
    # config.json -> ModelConfig fields beyond the Llama ones (loader.py reads those)
    config_fields: Callable[[dict[str, Any]], dict[str, Any]] = no_config_fields
    # (config, checkpoint name, tensor) -> the (name, tensor) pairs it stands for under the Llama
    # names the model loads (Phi-3's fused qkv_proj / gate_up_proj); None: names as they are.
    checkpoint_tensors: Optional[Callable[[ModelConfig, str, Any], Iterable[tuple[str, Any]]]] = None
    # how llama.cpp's converter writes the family (model/gguf_layout.py); None: no GGUF files
    gguf: Optional[GGUFLayout] = None


FAMILIES = {f.architecture: f for f in (
    # llama.cpp permutes q/k of the architectures it runs with interleaved rotary (Llama, Mistral);
    # Qwen2/Qwen3 GGUFs keep HF's order (its NEOX rotary).
    Family("LlamaForCausalLM", "llama", llama_spec, gguf=GGUFLayout("llama", rotary_permuted=True)),
    Family("MistralForCausalLM", "mistral", llama_spec, gguf=GGUFLayout("mistral", rotary_permuted=True)),
    Family("Qwen2ForCausalLM", "qwen2", llama_spec, gguf=GGUFLayout("qwen2")),
    Family("Qwen3ForCausalLM", "qwen3", llama_spec, gguf=GGUFLayout("qwen3")),
    Family(olmo2.ARCHITECTURE, olmo2.MODEL_TYPE, olmo2.spec, olmo2.Olmo2ForCausalLM, gguf=olmo2.GGUF),
    Family(gemma2.ARCHITECTURE, gemma2.MODEL_TYPE, gemma2.spec, gemma2.Gemma2ForCausalLM, gemma2.config_fields,
           gguf=gemma2.GGUF),
    Family(gemma3.ARCHITECTURE, gemma3.MODEL_TYPE, gemma3.spec, gemma3.Gemma3ForCausalLM, gemma3.config_fields,
           gemma3.checkpoint_tensors, gguf=gemma3.GGUF),
    Family(phi3.ARCHITECTURE, phi3.MODEL_TYPE, phi3.spec, phi3.Phi3ForCausalLM, phi3.config_fields,
           phi3.checkpoint_tensors, gguf=phi3.GGUF),
    Family(granite.ARCHITECTURE, granite.MODEL_TYPE, granite.spec, granite.GraniteForCausalLM,
           granite.config_fields, gguf=granite.GGUF),
    Family(smollm3.ARCHITECTURE, smollm3.MODEL_TYPE, smollm3.spec, smollm3.SmolLM3ForCausalLM,
           smollm3.config_fields, gguf=smollm3.GGUF),
    Family(qwen3_moe.ARCHITECTURE, qwen3_moe.MODEL_TYPE, qwen3_moe.spec, qwen3_moe.Qwen3MoeForCausalLM, qwen3_moe.config_fields,
           gguf=qwen3_moe.GGUF),
    Family(mixtral.ARCHITECTURE, mixtral.MODEL_TYPE, mixtral.spec, mixtral.MixtralForCausalLM, mixtral.config_fields,
           gguf=mixtral.GGUF),
    Family(olmoe.ARCHITECTURE, olmoe.MODEL_TYPE, olmoe.spec, olmoe.OlmoeForCausalLM, olmoe.config_fields,
           gguf=olmoe.GGUF),
    Family(qwen2_moe.ARCHITECTURE, qwen2_moe.MODEL_TYPE, qwen2_moe.spec, qwen2_moe.Qwen2MoeForCausalLM,
           qwen2_moe.config_fields, gguf=qwen2_moe.GGUF),
    Family(gpt_oss.ARCHITECTURE, gpt_oss.MODEL_TYPE, gpt_oss.spec, gpt_oss.GptOssForCausalLM, gpt_oss.config_fields),
)}

# Multimodal architectures served as their text model: config.json -> the text model's config.json
# (its "architectures" a family's above); the family's checkpoint_tensors takes the text tensors.
TEXT_MODEL_OF = {gemma3.MULTIMODAL_ARCHITECTURE: gemma3.text_config}

# HF architecture names we run, and the GGUF architecture strings (general.architecture) that map to them.
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
GGUF_ARCHITECTURES = {f.gguf.architecture: f.architecture for f in FAMILIES.values()
                      if f.gguf is not None and not f.gguf.moe}
# ... and the families a file of that string is when it has experts (expert_count > 0)
GGUF_MOE_ARCHITECTURES = {f.gguf.architecture: f.architecture for f in FAMILIES.values()
                          if f.gguf is not None and f.gguf.moe}


def get_family(architecture: str) -> Family:
    if architecture not in FAMILIES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; rooflm runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return FAMILIES[architecture]


def model_spec(cfg: ModelConfig) -> ModelSpec:
    return get_family(cfg.architecture).spec(cfg)


def get_model_class(architecture: str):
    return get_family(architecture).model_class
