"""`--load-format dummy` with an HF directory (config.json + tokenizer, no weights), and the
directory benchmarks/make_dummy_model_dir.py makes: a preset's shape with a real tokenizer."""

import json
import os

import pytest

from rooflm.model import loader
from rooflm.model.hf_config import hf_config_dict
from rooflm.tokenizer.dummy_model_dir import make_dummy_model_dir
from rooflm.model.presets import PRESETS
from rooflm.tokenizer.tokenizer import load_model_tokenizer


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_config_json_round_trips(name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(PRESETS[name])))
    assert loader.resolve_model(str(tmp_path), "dummy") == (str(tmp_path), "dummy")
    assert loader.load_model_config(str(tmp_path), "dummy") == PRESETS[name]
    # no tokenizer files: served with token ids only, as a preset is
    assert load_model_tokenizer(None, str(tmp_path), "dummy") is None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dummy") / "smollm2-dummy")
    config = make_dummy_model_dir("smollm2-135m", out, "default", max_position_embeddings=512)
    return out, config


def test_made_directory_is_small_and_self_consistent(tiny_dir):
    out, config = tiny_dir
    files = set(os.listdir(out))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "README.md"} <= files
    assert not any(f.endswith((".safetensors", ".bin", ".gguf")) for f in files)
    assert sum(os.path.getsize(os.path.join(out, f)) for f in files) < 10e6
    assert loader.load_model_config(out, "dummy") == config
    tokenizer = load_model_tokenizer(None, out, "dummy")
    assert tokenizer.vocab_size == config.vocab_size  # every sampled id decodes
    assert config.eos_token_ids == (tokenizer.eos_token_id,)
    assert tokenizer.chat_template
    assert json.loads(open(os.path.join(out, "tokenizer_config.json")).read())["chat_template"]


@pytest.mark.slow
def test_generate_text_from_dummy_weights(tiny_dir):
    from rooflm import LLM, SamplingParams

    out, _ = tiny_dir
    llm = LLM(model=out, load_format="dummy", device="cpu", max_model_len=128, num_blocks=16)
    [result] = llm.generate("The capital of France is",
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    sample = result.outputs[0]
    assert len(sample.token_ids) == 8
    assert sample.text and sample.text == llm.tokenizer.decode(sample.token_ids)
