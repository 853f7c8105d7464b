"""The decoder's choices made at init: which attention backend a family's layers run on, and that
fused paths are never handed a part they cannot compute."""

import pytest
import torch

from rooflm.layers.attention import AttentionBackend, ReferenceBackend, SoftcappedAttention
from rooflm.layers.cpu_attention import CpuBackend
from rooflm.layers.cuda_attention import TritonBackend
from rooflm.model.decoder import CausalLM, DecoderLayer, attention_backend
from rooflm.model.presets import PRESETS
from rooflm.model.registry import get_model_class, model_spec
from tests.models.tiny_models import make_tiny_model


class FusedOnly(AttentionBackend):
    """Stands in for a fused backend without soft-capping."""

    name = "fused"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_family_runs_on_the_one_decoder(name):
    config = PRESETS[name]
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=16)
    assert isinstance(model, CausalLM)
    assert all(type(layer) is DecoderLayer for layer in model.model.layers)
    llama = config.architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    llama = llama and not config.num_experts  # an MoE block is not the Llama layer
    assert model_spec(config).llama_layers == llama
    spec = model_spec(config)
    assert all(layer.native_reason == spec.native_reason() for layer in model.model.layers)
    if llama:
        assert spec.native_reason() is None  # the C decoder takes every Llama-family layer


def test_softcapped_attention_leaves_a_backend_without_softcap():
    spec = model_spec(PRESETS["gemma-2-9b"])
    assert isinstance(attention_backend(spec, FusedOnly()), ReferenceBackend)
    cpu = CpuBackend()
    assert attention_backend(spec, cpu) is cpu  # the CPU backend soft-caps through the reference math
    triton = TritonBackend()
    assert attention_backend(spec, triton) is triton  # the Triton kernels soft-cap (SOFTCAP_LOG2)


def test_plain_parts_keep_the_fused_backend():
    fused = FusedOnly()
    assert attention_backend(model_spec(PRESETS["olmo-2-7b"]), fused) is fused


def test_a_backend_without_softcap_is_refused():
    with pytest.raises(ValueError, match="cannot soft-cap"):
        SoftcappedAttention(4, 2, 16, None, 50.0, backend=FusedOnly())


def test_gemma2_windows_alternate():
    spec = model_spec(PRESETS["gemma-2-9b"])
    assert spec.layer_windows[:4] == (4096, None, 4096, None) and len(spec.layer_windows) == 42
    assert spec.attention_fallback(FusedOnly()) is not None
    assert spec.attention_fallback(TritonBackend()) is None


def test_a_model_whose_attention_falls_back_asks_for_eager_steps(tmp_path):
    """Gemma 2's soft-capped attention on a backend without soft-capping runs on the torch
    reference, which reads the step's host lists: the runner must not capture it in a CUDA graph
    (ModelRunner.capture_graphs reads this). On the Triton backend it captures."""
    from rooflm.model.loader import load_model_config

    for family, backend, unsafe in (("gemma2", FusedOnly(), True), ("llama", FusedOnly(), False),
                                    ("gemma2", TritonBackend(), False)):
        path, _ = make_tiny_model(tmp_path / f"{family}-{backend.name}", family)
        cfg = load_model_config(path, "safetensors")
        model = get_model_class(cfg.architecture)(cfg, max_positions=64, backend=backend)
        assert (model.graph_unsafe_reason is not None) == unsafe, (family, backend.name)
