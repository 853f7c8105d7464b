"""Gemma 3, Phi-3 / Phi-4-mini, Granite 3 and SmolLM3 against HF transformers: greedy tokens
equal and logprobs close (fp32, CPU) on tiny random checkpoints whose configs turn every option
of the family on (sliding and global layers, two RoPE bases and linear scaling, partial rotary
and LongRoPE with its attention factor, the four muP multipliers, layers without RoPE); their
safetensors load by name with nothing missing; the rotary tables equal HF's; and the presets
of their real shapes build and round-trip through config.json.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from rooflm import LLM, SamplingParams
from tests.models.test_hf_parity import assert_close_to_hf, hf_greedy

NEW_TOKENS = 32
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 60))]  # + NEW_TOKENS stays under 64 positions

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.3)

# Phi-4-mini's shape of LongRoPE at head_dim 16 with a 0.75 partial rotary: 12 rotated dims,
# 6 factors; the original context (64) holds every tiny prompt and its continuation.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}


def tiny_hf_config(family: str, **overrides):
    import transformers

    fields = dict(TINY)
    if family == "gemma3":
        # Six layers: five sliding ones with a window shorter than the prompts, one global; a
        # scale off 1/sqrt(head_dim); bases far apart, and the global one scaled.
        fields.update(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                      rope_theta=10000.0, rope_local_base_freq=100.0, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "linear", "factor": 4.0})
        cls = transformers.Gemma3TextConfig
    elif family == "phi3":
        fields.update(num_hidden_layers=2, partial_rotary_factor=0.75, original_max_position_embeddings=64,
                      rope_scaling=dict(LONGROPE), rope_theta=10000.0)
        cls = transformers.Phi3Config
    elif family == "granite":
        fields.update(num_hidden_layers=2, embedding_multiplier=4.0, residual_multiplier=0.5,
                      attention_multiplier=0.2, logits_scaling=3.0, rope_theta=10000.0)
        cls = transformers.GraniteConfig
    elif family == "smollm3":
        fields.update(num_hidden_layers=4, rope_theta=10000.0)  # layer 3 has no RoPE
        cls = transformers.SmolLM3Config
    else:
        raise ValueError(f"unknown family {family!r}")
    fields.update(overrides)
    return cls(**fields)


def make_tiny(root, family: str, name: str = "model", seed: int = 0, **overrides):
    """(checkpoint directory, HF model): save_pretrained of a tiny random model, with its norms
    drawn off their init (a swapped or dropped norm would otherwise still match)."""
    import transformers

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    model = model.float().eval()
    path = os.path.join(os.fspath(root), f"{family}-{name}")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


VARIANTS = [
    ("gemma3", "plain", {}),
    ("gemma3", "softcap-mqa", dict(final_logit_softcapping=8.0, num_key_value_heads=1)),
    ("phi3", "longrope-partial", {}),
    ("phi3", "window-tied", dict(partial_rotary_factor=1.0, rope_scaling=None, sliding_window=16,
                                 tie_word_embeddings=True)),
    ("granite", "multipliers", {}),
    ("granite", "tied-mha", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    ("smollm3", "nope", {}),
    ("smollm3", "nope-window", dict(use_sliding_window=True, sliding_window=8, no_rope_layer_interval=2)),
]


@pytest.mark.parametrize("family,name,overrides", VARIANTS, ids=[f"{f}-{n}" for f, n, _ in VARIANTS])
def test_tiny_family_greedy_matches_hf(tmp_path, family, name, overrides):
    path, hf_model = make_tiny(tmp_path, family, name, **overrides)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        tokens, logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_close_to_hf(out, tokens, logprobs)


@pytest.mark.parametrize("family", ["gemma3", "phi3", "granite", "smollm3"])
def test_safetensors_load_by_name(tmp_path, family):
    """Every checkpoint tensor lands on a parameter, and every parameter is set."""
    from safetensors import safe_open

    from rooflm.model.loader import iter_weights, load_model_config, weight_shapes
    from rooflm.model.registry import get_model_class

    path, hf_model = make_tiny(tmp_path, family)
    config = load_model_config(path, "safetensors")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    if family == "phi3":  # the fused checkpoint names, cut on the way in
        assert "model.layers.0.self_attn.qkv_proj.weight" in stored
        assert "model.layers.0.mlp.gate_up_proj.weight" in stored
    names = [name for name, _ in iter_weights(path, "safetensors")]
    assert sorted(names) == sorted(weight_shapes(config))
    model = get_model_class(config.architecture)(config, max_positions=64)
    model.load_weights(iter_weights(path, "safetensors"))  # raises on anything missing
    hf_state = hf_model.state_dict()
    ours = dict(model.named_parameters())
    assert torch.equal(ours["model.embed_tokens.weight"], hf_state["model.embed_tokens.weight"])
    qkv = ours["model.layers.1.self_attn.qkv_proj.weight"]
    if family == "phi3":
        assert torch.equal(qkv, hf_state["model.layers.1.self_attn.qkv_proj.weight"])
    else:
        assert torch.equal(qkv[:config.q_size], hf_state["model.layers.1.self_attn.q_proj.weight"])


def test_gemma3_multimodal_directory_runs_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (4B-27B's layout: language_model.*, a vision
    tower, a projector) serves its text model: HF's greedy tokens on a text-only prompt. HF's
    multimodal class ignores final_logit_softcapping, and so does rooflm for it."""
    import transformers

    text = tiny_hf_config("gemma3", final_logit_softcapping=8.0)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=255, boi_token_index=253,
                                       eoi_token_index=254)  # none in the prompts
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    path = str(tmp_path / "gemma3-mm")
    hf_model.save_pretrained(path)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    assert llm.engine.model_config.architecture == "Gemma3ForCausalLM"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        tokens, logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_close_to_hf(out, tokens, logprobs)


def test_phi3_fused_tensors_load_lazily_by_rows(tmp_path):
    """Tensor-parallel loading reads lazy slices: a cut qkv_proj narrows to its rows unread."""
    from rooflm.model.loader import LazySlice, iter_weights

    path, hf_model = make_tiny(tmp_path, "phi3")
    fused = hf_model.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
    parts = {name: t for name, t in iter_weights(path, "safetensors", lazy=True)
             if name.startswith("model.layers.0.self_attn.") and "o_proj" not in name}
    k = parts["model.layers.0.self_attn.k_proj.weight"]
    assert not isinstance(k, (torch.Tensor, LazySlice)) and k.shape == (32, 64)
    assert torch.equal(k.narrow(0, 16, 16), fused[64 + 16:64 + 32])
    assert torch.equal(k.load(), fused[64:96])


def _hf_cos(rotary_emb, positions, **kw):
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary_emb(x, positions[None], **kw)
    return cos[0], sin[0]


def _our_cos(rotary, positions):
    cos, sin = rotary.cos_sin_cache[positions].chunk(2, dim=-1)
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def test_longrope_table_is_hfs_on_both_sides_of_the_original_context():
    """Below original_max_position_embeddings HF uses the short factors; from it on (a forward
    whose longest position passes it) the long ones. The table holds each where HF would."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from rooflm.layers.rotary import RotaryEmbedding, rope_scaling_from_hf

    config = tiny_hf_config("phi3")
    hf = Phi3RotaryEmbedding(config)
    scaling = rope_scaling_from_hf(dict(LONGROPE), 256, 64)
    assert scaling.factor == 4.0 and scaling.original_max_position_embeddings == 64
    ours = RotaryEmbedding(16, 256, 10000.0, scaling, rotary_dim=12)
    short, long = torch.arange(0, 64), torch.arange(64, 200)
    for positions in (short, long):
        for a, b in zip(_our_cos(ours, positions), _hf_cos(hf, positions)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # The attention factor is on the table (sqrt(1 + ln 4 / ln 64) = 1.15...).
    assert float(ours.cos_sin_cache[0, 0]) == pytest.approx(hf.attention_scaling) and hf.attention_scaling > 1.1


def test_gemma3_tables_are_hfs_per_layer_type():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from rooflm.model.gemma3 import config_fields, spec
    from rooflm.config import ModelConfig

    hf_config = tiny_hf_config("gemma3")
    raw = json.loads(hf_config.to_json_string())
    fields = config_fields(raw)
    cfg = ModelConfig(architecture="Gemma3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **fields)
    assert cfg.rope_local_theta == 100.0 and cfg.rope_scaling.rope_type == "linear"
    from rooflm.layers.rotary import shared_rotaries
    rotaries = shared_rotaries(spec(cfg).ropes(cfg), 16, 128)
    assert rotaries[0] is rotaries[4] and rotaries[5] is not rotaries[0]
    hf = Gemma3RotaryEmbedding(hf_config)
    positions = torch.arange(100)
    for layer, layer_type in ((0, "sliding_attention"), (5, "full_attention")):
        for a, b in zip(_our_cos(rotaries[layer], positions), _hf_cos(hf, positions, layer_type=layer_type)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_smollm3_layers_without_rope_follow_hf_config():
    from transformers import SmolLM3Config

    from rooflm.layers.rotary import NoRotary
    from rooflm.model.smollm3 import config_fields

    for kw in ({}, {"no_rope_layer_interval": 3}, {"no_rope_layers": [1, 0, 1, 1, 0, 1]}):
        hf = SmolLM3Config(num_hidden_layers=6, **kw)
        raw = json.loads(hf.to_json_string())
        raw.pop("no_rope_layers") if "no_rope_layers" not in kw else None  # the interval alone
        assert list(config_fields(raw)["no_rope_layers"]) == list(hf.no_rope_layers)
    from rooflm.model.presets import PRESETS
    from rooflm.model.registry import get_model_class
    with torch.device("meta"):
        model = get_model_class("SmolLM3ForCausalLM")(PRESETS["smollm3-3b"], max_positions=16)
    nope = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn.attn.rotary, NoRotary)]
    assert nope == list(range(3, 36, 4))


NEW_PRESETS = ["gemma-3-12b", "gemma-3-1b", "phi-4-mini", "granite-3-8b", "smollm3-3b"]


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_preset_round_trips_through_config_json(tmp_path, name):
    """The preset's config.json (model/hf_config.py) reads back to the same ModelConfig, and
    transformers reads it as the same family."""
    import transformers

    from rooflm.model.hf_config import hf_config_dict
    from rooflm.model.loader import load_model_config
    from rooflm.model.presets import PRESETS

    config = PRESETS[name]
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config_dict(config)))
    assert load_model_config(str(path), "dummy") == config
    hf = transformers.AutoConfig.from_pretrained(str(path))
    assert hf.architectures == [config.architecture] and hf.num_hidden_layers == config.num_hidden_layers


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_preset_builds_its_parts(name):
    from rooflm.model.decoder import DecoderLayer
    from rooflm.model.presets import PRESETS
    from rooflm.model.registry import get_model_class, model_spec

    config = PRESETS[name]
    assert not model_spec(config).llama_layers
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=16)
    assert all(type(layer) is DecoderLayer for layer in model.model.layers)
    rotary = model.model.layers[0].self_attn.attn.rotary
    if name == "phi-4-mini":  # 96 of 128 dims rotated: the fused rope+write kernel passes it by
        assert rotary.cos_sin_cache.shape[-1] == 96


GPU_FAMILIES = [("gemma3", {}), ("phi3", {}), ("granite", {}), ("smollm3", dict(use_sliding_window=True,
                                                                                 sliding_window=8))]


@pytest.mark.gpu
@pytest.mark.parametrize("family,overrides", GPU_FAMILIES, ids=[f for f, _ in GPU_FAMILIES])
def test_gpu_graphs_match_eager_and_triton_matches_reference(tmp_path, family, overrides):
    """On CUDA: CUDA graphs replay the eager tokens (Gemma 3's sliding and global layers each on
    their own window's launch plan); the Triton path matches the torch reference (fp32); HF on
    the GPU agrees on the first token."""
    from tests.models.test_gpu_e2e import PROMPTS as GPU_PROMPTS
    from tests.models.test_gpu_e2e import check_greedy_close, generate

    path, hf = make_tiny(tmp_path, family, **overrides)
    eager = generate(path, GPU_PROMPTS, "triton", True)
    graphs = generate(path, GPU_PROMPTS, "triton", False, piecewise_cuda_graphs=False)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    ref = generate(path, GPU_PROMPTS, "reference", True, dtype="float32")
    fast = generate(path, GPU_PROMPTS, "triton", False, dtype="float32")
    check_greedy_close(fast, ref)
    hf = hf.cuda().float()
    # LongRoPE (Phi-3): HF rotates a whole forward with the long factors once it passes the original
    # context, rooflm each position by its own (docs/models.md); they agree on prompts inside it.
    within = getattr(hf.config, "original_max_position_embeddings", None) or float("inf")
    with torch.no_grad():
        for prompt, out in zip(GPU_PROMPTS, fast):
            if len(prompt) > within:
                continue
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1]
            assert int(logits.argmax()) == out.outputs[0].token_ids[0]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NEW_PRESETS)
def test_gpu_preset_shape_runs_with_graphs(name):
    """The real shape with dummy weights: graphs and eager give the same greedy tokens (bf16)."""
    from tests.models.test_gpu_e2e import check_greedy_close, generate

    prompts = [list(range(100, 228)), list(range(500, 517))]
    kw = dict(load_format="dummy", max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.8)
    eager = generate(name, prompts, "triton", True, **kw)
    graphs = generate(name, prompts, "triton", False, **kw)
    check_greedy_close(graphs, eager)
