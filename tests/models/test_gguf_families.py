"""GGUF files of Gemma 2, Gemma 3, Phi-3, Granite, OLMo 2 and SmolLM3, written here the way
llama.cpp's convert_hf_to_gguf.py lays each family out (its metadata keys and defaults, gguf-py's
tensor names, q/k permuted for the families it converts as a Llama, Gemma's norms stored as
1 + w, Phi-3's fused attn_qkv and gate|up ffn_up, LongRoPE as rope_factors tensors), from tiny
HF models whose weights are first rounded to the file's storage (F16, Q8_0, Q4_0), so the file
and the safetensors checkpoint hold the same model: loaded from the GGUF, rooflm must get the
safetensors config and weights exactly, and HF's greedy tokens and logprobs; transformers' own
GGUF loader, for the architectures it reads, must agree too.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from rooflm import LLM, SamplingParams
from rooflm.config import RopeScaling
from rooflm.model.loader import iter_weights, load_model_config
from tests.models import test_families_parity as new_families
from tests.models import tiny_models
from tests.models.test_hf_parity import assert_close_to_hf, hf_greedy
from tests.unit.test_gguf_formats import _word_level_tokenizer

gguf = pytest.importorskip("gguf")

NEW_TOKENS = 16
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 50))]

# family -> GGUF general.architecture (the converter's model_arch)
GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "granite": "granite",
             "olmo2": "olmo2", "smollm3": "smollm3"}
# Converted as a LlamaModel subclass (undo_permute): q/k rows permuted for llama.cpp's rotary.
PERMUTED = ("granite", "smollm3")
# Gemma2Model / Gemma3Model add 1 to every tensor named *norm.weight.
NORM_PLUS_ONE = ("gemma2", "gemma3")


# ---------------------------------------------------------------------------
# Tiny models, rounded to the file's storage
# ---------------------------------------------------------------------------

def hf_config(family: str, **overrides):
    if family in ("olmo2", "gemma2"):  # every Gemma ties its head (the converter drops lm_head)
        return tiny_models.tiny_hf_config(family, tied=family == "gemma2", initializer_range=0.3, **overrides)
    return new_families.tiny_hf_config(family, **overrides)


def storage_roundtrip(array: np.ndarray, fmt: str) -> np.ndarray:
    """What a 2-D weight reads back as from the file (quantizing that again is exact)."""
    if fmt == "F32":
        return array
    if fmt == "F16":
        return array.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[fmt]
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(array.shape)


def make_model(root, family: str, fmt: str = "F32", name: str = "model", **overrides):
    """(safetensors directory, HF model): norms drawn off their init, 2-D weights rounded as `fmt`
    stores them (the embedding and head as the converter's outtype; Q4_0 is a llama-quantize type,
    for the decoder layers' matrices only)."""
    import transformers

    config = hf_config(family, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif param.dim() == 2:
                param_fmt = fmt if fmt != "Q4_0" or pname.startswith("model.layers.") else "F16"
                param.copy_(torch.from_numpy(storage_roundtrip(param.numpy(), param_fmt)))
    path = os.path.join(os.fspath(root), f"{family}-{name}")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


# ---------------------------------------------------------------------------
# The converter's layout, per family (convert_hf_to_gguf.py's set_gguf_parameters / modify_tensors)
# ---------------------------------------------------------------------------

def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """LlamaModel.permute: each head's two rotary halves interleaved."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _full_attention_rope(cfg) -> dict:
    params = cfg.rope_parameters or {}
    return params.get("full_attention", params)


def _text_model_metadata(w, cfg, write_swa_base: bool) -> None:
    """TextModel.set_gguf_parameters: what every family not writing its own gets (the sliding
    layers' base from transformers >= 5's per-layer-type rope_parameters; write_swa_base False:
    a converter or config.json from before those)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = _full_attention_rope(cfg)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_freq_base(rope["rope_theta"])
    sliding = (cfg.rope_parameters or {}).get("sliding_attention", {})
    if "rope_theta" in sliding and write_swa_base:
        w.add_rope_freq_base_swa(sliding["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def _metadata(w, family: str, cfg, write_swa_base: bool = True) -> None:
    if family == "gemma2":  # Gemma2Model writes its own (no rope base: llama.cpp's 10000)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    elif family == "phi3":  # Phi3MiniModel writes its own
        n_head = cfg.num_attention_heads
        rope = cfg.rope_parameters
        w.add_context_length(cfg.max_position_embeddings)
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 cfg.max_position_embeddings))
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(n_head)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // n_head)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("long_factor"):
            original = rope["original_max_position_embeddings"]
            scale = cfg.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original))
                                            if scale > 1.0 else 1.0)
    else:
        _text_model_metadata(w, cfg, write_swa_base)
        if family == "gemma3":
            if cfg.final_logit_softcapping:
                w.add_final_logit_softcapping(cfg.final_logit_softcapping)
            w.add_sliding_window(cfg.sliding_window)
        elif family == "granite":  # GraniteModel: the multipliers under llama.cpp's names
            w.add_attention_scale(cfg.attention_multiplier)
            w.add_embedding_scale(cfg.embedding_multiplier)
            w.add_residual_scale(cfg.residual_multiplier)
            w.add_logit_scale(cfg.logits_scaling)
        if family in PERMUTED:  # LlamaModel: the vocabulary size and the rotated width
            w.add_vocab_size(cfg.vocab_size)
            w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    # set_vocab: a token list of the vocabulary's size (transformers' GGUF reader takes vocab_size
    # from it where the converter writes none), named like the test tokenizer's words.
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(0)


def _add(w, name: str, array: np.ndarray, fmt: str) -> None:
    if array.ndim == 1 or fmt == "F32":
        w.add_tensor(name, array.astype(np.float32))
    elif fmt == "F16":
        w.add_tensor(name, array.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[fmt]
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_gguf(path: str, hf_model, family: str, fmt: str = "F32", write_swa_base: bool = True) -> None:
    cfg = hf_model.config
    arch = GGUF_ARCH[family]
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, family, cfg, write_swa_base)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and (cfg.tie_word_embeddings or family in NORM_PLUS_ONE):
            continue  # tied, or a Gemma (its converter drops lm_head)
        array = tensor.float().numpy().copy()
        module, suffix = hf_name.rsplit(".", 1)
        if family in PERMUTED and module.endswith("q_proj"):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif family in PERMUTED and module.endswith("k_proj"):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if family in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            array = array + 1
        tensor_fmt = fmt if fmt != "Q4_0" or module.startswith("model.layers.") else "F16"
        _add(w, f"{name_map.get_name(module)}.{suffix}", array, tensor_fmt)
    rope = cfg.rope_parameters or {}
    if family == "phi3" and rope.get("long_factor"):
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------

def _close(a, b) -> bool:
    """Equal, floats to float32's precision (the file stores float32 metadata)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, RopeScaling) and isinstance(b, RopeScaling):
        return all(_close(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(RopeScaling))
    return a == b


def assert_same_config(gguf_config, safetensors_config) -> None:
    differ = [f.name for f in dataclasses.fields(gguf_config)
              if not _close(getattr(gguf_config, f.name), getattr(safetensors_config, f.name))]
    assert not differ, {n: (getattr(gguf_config, n), getattr(safetensors_config, n)) for n in differ}


def assert_same_weights(gguf_path: str, safetensors_path: str, family: str) -> None:
    """Every weight equal; a Gemma norm by the scale it applies, 1 + w in fp32: the file holds
    fl(1 + w), and (fl(1 + w) - 1) + 1 is fl(1 + w) again, though fl(1 + w) - 1 is not always w."""
    ours = dict(iter_weights(gguf_path, "gguf"))
    theirs = {n: t.load() if hasattr(t, "load") else t for n, t in iter_weights(safetensors_path, "safetensors")}
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        expected = theirs[name].float()
        if family in NORM_PLUS_ONE and name.endswith("norm.weight"):
            tensor, expected = 1.0 + tensor, 1.0 + expected
        assert torch.equal(tensor, expected), name


def _generate(model: str, tokenizer: str, **kw):
    llm = LLM(model=model, dtype="float32", device="cpu", block_size=4, enable_prefix_caching=False,
              tokenizer=tokenizer, **kw)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    return llm.generate(PROMPTS, params, use_tqdm=False)


# Each family's options that a GGUF carries, turned on at tiny scale. Gemma's query_pre_attn_scalar
# is head_dim (the converter writes none; llama.cpp's rule for every Gemma but the 27B), and the
# Phi-3 / SmolLM3 variants whose options no GGUF key holds (SmolLM3's no-RoPE interval is 4) are
# left to the safetensors parity tests.
VARIANTS = [
    ("gemma2", "F32", {}, dict(query_pre_attn_scalar=16)),
    ("gemma2", "F16", {}, dict(query_pre_attn_scalar=16, attention="mqa")),
    ("gemma3", "F32", {}, dict(query_pre_attn_scalar=16, final_logit_softcapping=8.0)),
    ("gemma3", "Q4_0", dict(write_swa_base=False), dict(query_pre_attn_scalar=16, rope_local_base_freq=10000.0)),
    ("phi3", "F32", {}, {}),
    ("phi3", "Q8_0", {}, dict(partial_rotary_factor=1.0, rope_scaling=None, sliding_window=16,
                              tie_word_embeddings=True)),
    ("granite", "F16", {}, {}),
    ("olmo2", "F32", {}, {}),
    ("smollm3", "F16", {}, {}),
]


def _variant_id(v):
    family, fmt, write, overrides = v
    return "-".join([family, fmt] + [k for k in overrides if k != "query_pre_attn_scalar"] + list(write))


@pytest.mark.parametrize("family,fmt,write,overrides", VARIANTS, ids=[_variant_id(v) for v in VARIANTS])
def test_gguf_is_the_safetensors_model(tmp_path, family, fmt, write, overrides):
    attention = overrides.pop("attention", None)
    if attention is not None:
        overrides["num_key_value_heads"] = tiny_models.KV_HEADS[attention]
    path, hf_model = make_model(tmp_path, family, fmt, **overrides)
    gguf_path = str(tmp_path / f"{family}-{fmt}.gguf")
    write_gguf(gguf_path, hf_model, family, fmt, **write)

    assert_same_config(load_model_config(gguf_path, "gguf"), load_model_config(path, "safetensors"))
    assert_same_weights(gguf_path, path, family)
    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer")
    from_gguf = _generate(gguf_path, tokenizer, quantization="none")
    from_safetensors = _generate(path, tokenizer)
    for prompt, ours, theirs in zip(PROMPTS, from_gguf, from_safetensors):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in a.items()} == pytest.approx(
                {t: lp.logprob for t, lp in b.items()}, abs=1e-5)
        tokens, logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_close_to_hf(ours, tokens, logprobs)


# Configs inside what transformers' GGUF reader maps (it reads no soft-cap, scalar, local base,
# rotated width or LongRoPE, and takes its config class's defaults for them), so its model of the
# file is the model; Gemma's head_dim is then 256, as in every released Gemma.
TRANSFORMERS_READS = [
    ("phi3", dict(partial_rotary_factor=1.0, rope_scaling=None)),
    ("gemma2", dict(head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0)),
    ("gemma3", dict(head_dim=256, query_pre_attn_scalar=256, rope_local_base_freq=10000.0,
                    rope_theta=1_000_000.0, rope_scaling=None)),
]


@pytest.mark.parametrize("family,overrides", TRANSFORMERS_READS, ids=[f for f, _ in TRANSFORMERS_READS])
def test_gguf_matches_transformers_gguf_loader(tmp_path, family, overrides):
    import transformers

    _, hf_model = make_model(tmp_path, family, "F16", **overrides)
    gguf_path = str(tmp_path / f"{family}.gguf")
    write_gguf(gguf_path, hf_model, family, "F16")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32,
        attn_implementation="eager").eval()
    outs = _generate(gguf_path, _word_level_tokenizer(tmp_path / "tokenizer"), quantization="none")
    for prompt, ours in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy(theirs, prompt, NEW_TOKENS)
        assert_close_to_hf(ours, tokens, logprobs)


def test_phi3_fused_blocks_are_cut_by_rows(tmp_path):
    """Q8_0 attn_qkv and ffn_up stay in their blocks, cut into q/k/v and gate/up rows (the blocks
    run along each row), equal to the dequantized stream; served from the blocks, the greedy
    tokens are the dequantized model's."""
    from rooflm.quant.gguf_blocks import BlockTensor

    _, hf_model = make_model(tmp_path, "phi3", "Q8_0")
    gguf_path = str(tmp_path / "phi3-q8.gguf")
    write_gguf(gguf_path, hf_model, "phi3", "Q8_0")
    blocks = dict(iter_weights(gguf_path, "gguf", keep_quantized=True))
    floats = dict(iter_weights(gguf_path, "gguf"))
    assert isinstance(blocks["model.layers.0.self_attn.k_proj.weight"], BlockTensor)
    assert isinstance(blocks["model.layers.1.mlp.up_proj.weight"], BlockTensor)
    for name, tensor in blocks.items():
        value = tensor.dequantize() if isinstance(tensor, BlockTensor) else tensor
        assert torch.equal(value, floats[name]), name
    fused = hf_model.state_dict()["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(floats["model.layers.1.mlp.up_proj.weight"], fused[128:])

    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer")
    kept, dequantized = _generate(gguf_path, tokenizer), _generate(gguf_path, tokenizer, quantization="none")
    assert [o.outputs[0].token_ids for o in kept] == [o.outputs[0].token_ids for o in dequantized]


# ---------------------------------------------------------------------------
# Metadata llama.cpp reads by rule, not key
# ---------------------------------------------------------------------------

def test_gemma_attention_scalar_follows_llama_cpps_rule():
    """No key holds query_pre_attn_scalar: hidden/heads for the 27B models (Gemma 2: 46 layers,
    Gemma 3: 62), head_dim for the rest -- each released config.json's value."""
    from rooflm.model.gemma2 import gguf_query_pre_attn_scalar

    gemma2_27b = dict(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32, head_dim=128)
    gemma3_27b = dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128)
    gemma3_12b = dict(num_hidden_layers=48, hidden_size=3840, num_attention_heads=16, head_dim=256)
    assert gguf_query_pre_attn_scalar(gemma2_27b, largest_model_layers=46) == 144.0
    assert gguf_query_pre_attn_scalar(gemma3_27b, largest_model_layers=62) == 168.0
    assert gguf_query_pre_attn_scalar(gemma3_12b, largest_model_layers=62) == 256.0


def _config_only_gguf(path: str, family: str, extra) -> None:
    """The metadata of a tiny model and its embedding alone: enough for the config."""
    cfg = hf_config(family)
    w = gguf.GGUFWriter(path, GGUF_ARCH[family])
    _metadata(w, family, cfg)
    extra(w)
    w.add_tensor("token_embd.weight", np.zeros((cfg.vocab_size, cfg.hidden_size), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pattern,expected", [
    ([True, False], ("sliding_attention", "full_attention")),
    (2, ("sliding_attention", "full_attention")),
    (None, ("sliding_attention", "sliding_attention")),  # OLMo 3's period of 4 over two layers
])
def test_olmo3_windows_from_the_pattern(tmp_path, pattern, expected):
    """The converter writes OLMo 3 as olmo2 with a window and its per-layer pattern (or llama.cpp's
    period where none is written): sliding layers, every 4th global."""
    path = str(tmp_path / "olmo3.gguf")

    def window(w):
        w.add_sliding_window(8)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)

    _config_only_gguf(path, "olmo2", window)
    config = load_model_config(path, "gguf")
    assert config.sliding_window == 8 and config.layer_types == expected


def test_gguf_rope_scaling_rooflm_does_not_run_is_named(tmp_path):
    from rooflm.model.loader import ModelLoadError

    path = str(tmp_path / "yarn.gguf")
    _config_only_gguf(path, "olmo2", lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                                 w.add_rope_scaling_factor(8.0)))
    with pytest.raises(ModelLoadError, match=r"yarn\.gguf: GGUF rope scaling 'yarn' is not supported"):
        load_model_config(path, "gguf")


def test_smollm3_gguf_skips_rope_every_fourth_layer(tmp_path):
    path = str(tmp_path / "smollm3.gguf")
    _config_only_gguf(path, "smollm3", lambda w: None)
    assert load_model_config(path, "gguf").no_rope_layers == (1, 1, 1, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("family,fmt", [("gemma3", "Q4_0"), ("phi3", "Q8_0"), ("granite", "Q8_0")])
def test_quantized_gguf_on_cuda_matches_its_dequantized_copy(tmp_path, family, fmt):
    """On one CUDA device (bf16, CUDA graphs) the blocks go to the W4A16 / W8A16 kernels
    (quantization "gguf"), against the same file dequantized: a family's parts and its GGUF names
    together on the GPU path."""
    from tests.models.test_gpu_e2e import check_greedy_close

    _, hf_model = make_model(tmp_path, family, fmt, **({"query_pre_attn_scalar": 16} if family == "gemma3" else {}))
    gguf_path = str(tmp_path / f"{family}-{fmt}.gguf")
    write_gguf(gguf_path, hf_model, family, fmt)
    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    outs = []
    for quantization in ("gguf", "none"):
        llm = LLM(model=gguf_path, device="cuda", dtype="bfloat16", max_model_len=256, tokenizer=tokenizer,
                  quantization=quantization, enable_prefix_caching=False)
        outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        del llm
    check_greedy_close(*outs)


@pytest.mark.parametrize("family,fmt,overrides", [
    ("gemma3", "Q4_0", dict(query_pre_attn_scalar=16, rope_local_base_freq=10000.0)),
    ("phi3", "Q8_0", dict(partial_rotary_factor=1.0, rope_scaling=None, sliding_window=16)),
    ("granite", "Q8_0", {}),
])
def test_quantized_gguf_runs_the_native_cpu_decoder(tmp_path, family, fmt, overrides, monkeypatch):
    """A quantized file of a parts family keeps its blocks on the CPU and runs single-sequence steps
    through the native C decoder (post-norms, (1 + w) norms, q/k norms, GELU-tanh, windows, KV cache
    groups, multipliers), with the torch path's greedy tokens on the same blocks."""
    from rooflm.quant import native
    if native.library() is None:
        pytest.skip("no C compiler or no AVX2/FMA: native kernels not built")
    _, hf_model = make_model(tmp_path, family, fmt, **overrides)
    gguf_path = str(tmp_path / f"{family}-{fmt}.gguf")
    write_gguf(gguf_path, hf_model, family, fmt)
    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("ROOFLM_NATIVE_DECODE", switch)
        llm = LLM(model=gguf_path, dtype="float32", device="cpu", block_size=4, tokenizer=tokenizer)
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)  # the path is chosen at the first step
        decoder = llm.engine.runner.model.model.native_decoder
        assert (decoder is not None) == (switch == "1")
        ran = []
        if decoder is not None:  # count the steps it took (forward returns None to decline one)
            real = decoder.forward
            decoder.forward = lambda *a, **k: (lambda out: (ran.append(out is not None), out)[1])(real(*a, **k))
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]  # one sequence a step
        if decoder is not None:
            assert ran and all(ran), "the native decoder declined steps it should take"
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
