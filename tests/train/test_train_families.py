"""The training lab refuses a family whose layers are not the Llama layer it trains."""

import pytest
import torch

from rooflm.train.trainer import build_model
from tests.models.tiny_models import make_tiny_model


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_training_refuses_parts_families(tmp_path, family):
    path, _ = make_tiny_model(tmp_path, family)
    with pytest.raises(ValueError, match="Llama-layer families only"):
        build_model(path, "safetensors", torch.device("cpu"), seq_len=16, seed=0)


def test_training_builds_a_llama_family(tmp_path):
    path, _ = make_tiny_model(tmp_path, "llama")
    cfg, lm, _, _ = build_model(path, "safetensors", torch.device("cpu"), seq_len=16, seed=0)
    assert cfg.architecture == "LlamaForCausalLM" and lm is not None
