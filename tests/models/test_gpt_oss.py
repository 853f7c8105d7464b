"""gpt-oss end to end against HF transformers (fp32, CPU): a tiny random GptOssForCausalLM saved by
transformers (stacked experts, sinks, q/k/v/o biases) run through rooflm's engine. Greedy tokens
equal to HF's, logprobs within 1e-3, with every gpt-oss part acting at this scale: 8-token windows
on even layers (prompts of 30 tokens), YaRN with a ramp inside the head (original context 32,
factor 4), sinks of magnitude ~1, a swiglu_limit the gate and up projections cross."""

import os
from dataclasses import replace

import pytest
import torch

from rooflm import LLM, SamplingParams
from rooflm.layers.moe import SparseMoeBlock
from rooflm.model.registry import get_model_class
from tests.models.test_hf_parity import assert_close_to_hf, hf_greedy
from tests.models.tiny_models import TINY_SHAPE, _randomize_norms_and_biases

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def tiny_gpt_oss_config(**overrides):
    return transformers.GptOssConfig(**{
        **TINY_SHAPE, "head_dim": 16, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 48, "sliding_window": 8, "rope_parameters": dict(YARN), "swiglu_limit": 1.5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.3,
        "experts_implementation": "eager", "attn_implementation": "eager", **overrides})


def make_tiny_gpt_oss(root, seed: int = 0, **overrides):
    """(checkpoint directory, HF model) of a tiny random gpt-oss, fp32."""
    config = tiny_gpt_oss_config(**overrides)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    _randomize_norms_and_biases(model, gen)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
            layer.mlp.experts.gate_up_proj_bias.copy_(0.1 * torch.randn(layer.mlp.experts.gate_up_proj_bias.shape,
                                                                        generator=gen))
    model = model.float().eval()
    path = os.path.join(os.fspath(root), f"gpt-oss-seed{seed}")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def test_tiny_gpt_oss_greedy_matches_hf(tiny):
    path, hf_model = tiny
    prompts = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 60))]
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_close_to_hf(out, tokens, logprobs)


def test_config_and_parts_follow_hf(tiny):
    """The config fields read from config.json, and every part holding HF's tensors exactly."""
    from rooflm.model.loader import load_model_config
    path, hf_model = tiny
    cfg = load_model_config(path, "safetensors")
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 8
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.attention_sinks and cfg.moe_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.swiglu_limit) == (4, 2, 1.5)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.truncate is False
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    model = llm.engine.runner.model
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, None]
    for ours, hf in zip(model.model.layers, hf_model.model.layers):
        assert isinstance(ours.mlp, SparseMoeBlock)
        torch.testing.assert_close(ours.self_attn.sinks, hf.self_attn.sinks, rtol=0, atol=0)
        torch.testing.assert_close(ours.self_attn.o_proj.bias, hf.self_attn.o_proj.bias, rtol=0, atol=0)
        torch.testing.assert_close(ours.mlp.router.bias, hf.mlp.router.bias, rtol=0, atol=0)
        gate_up = hf.mlp.experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H], gate/up rows alternating
        torch.testing.assert_close(ours.mlp.experts.w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1),
                                   rtol=0, atol=0)
        torch.testing.assert_close(ours.mlp.experts.w2, hf.mlp.experts.down_proj.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("part", ["sinks", "windows", "yarn", "o_proj bias"])
def test_each_part_acts_at_this_scale(tiny, part):
    """Each gpt-oss part moves the tiny model's logits: the parity test, passing with it, would fail
    without it."""
    from rooflm.model.loader import iter_weights, load_model_config
    path, _ = tiny
    cfg = load_model_config(path, "safetensors")
    weights = list(iter_weights(path, "safetensors"))
    if part == "windows":
        off_cfg = replace(cfg, sliding_window=None)
    elif part == "yarn":
        off_cfg = replace(cfg, rope_scaling=None)
    else:
        off_cfg = cfg

    def logits(cfg, off):
        model = get_model_class(cfg.architecture)(cfg, max_positions=64)
        model.load_weights(iter(weights))
        with torch.no_grad():
            for layer in model.model.layers:
                if off and part == "sinks":
                    layer.self_attn.sinks.fill_(-1e4)  # exp(sink) = 0 in every denominator
                if off and part == "o_proj bias":
                    layer.self_attn.o_proj.bias.zero_()
        return _prefill_logits(model, cfg)

    assert (logits(cfg, False) - logits(off_cfg, True)).abs().max() > 1e-2


def _prefill_logits(model, cfg):
    """The logits of a 30-token prompt through the reference backend, one sequence, block size 4."""
    from rooflm.layers.attention import AttentionMetadata
    tokens = 30
    block_size, blocks = 4, 8
    kv = [(torch.zeros(blocks, block_size, cfg.num_key_value_heads, cfg.head_dim),
           torch.zeros(blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(tokens), query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
                             seq_lens=torch.tensor([tokens], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None], max_query_len=tokens,
                             max_seq_len=tokens, num_decodes=0, query_start_loc_cpu=[0, tokens], seq_lens_cpu=[tokens])
    with torch.no_grad():
        hidden = model(torch.arange(30, 60), torch.arange(tokens), kv, meta)
        return model.compute_logits(hidden)


def test_dummy_weights_load_back_into_the_model(tiny):
    """dummy_weights yields gpt-oss's stacked checkpoint names and shapes; load_weights takes them
    back, nothing missing, and the model equals init_dummy_weights' draws."""
    from rooflm.model.loader import load_model_config, weight_shapes
    path, _ = tiny
    cfg = load_model_config(path, "safetensors")
    model_class = get_model_class(cfg.architecture)
    drawn = model_class(cfg, max_positions=64)
    drawn.init_dummy_weights(seed=3)
    tensors = dict(drawn.dummy_weights(seed=3))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == weight_shapes(cfg)
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 96)
    loaded = model_class(cfg, max_positions=64)
    for p in loaded.parameters():
        p.data.fill_(float("nan"))
    loaded.load_weights(tensors.items())
    for (name, a), b in zip(drawn.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    victim = "model.layers.1.self_attn.sinks"
    with pytest.raises(ValueError, match="missing 1 tensors"):
        model_class(cfg, max_positions=64).load_weights((n, t) for n, t in tensors.items() if n != victim)


def test_preset_counts_and_shapes():
    """gpt-oss-20b: OpenAI's 20.91B parameters (3.61B active without the embedding), and a parameter
    for every checkpoint tensor the loader expects (built on the meta device)."""
    from rooflm.model.decoder import _fused_targets
    from rooflm.model.loader import weight_shapes
    from rooflm.model.presets import get_preset
    config = get_preset("gpt-oss-20b")
    assert config.num_params() == pytest.approx(20.91e9, rel=1e-3)
    embedding = config.vocab_size * config.hidden_size
    assert config.num_active_params() - embedding == pytest.approx(3.61e9, rel=1e-3)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=16)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    params = dict(model.named_parameters())
    expected = set()
    for tensor, shape in weight_shapes(config).items():
        for target, shard, kind in _fused_targets(tensor):
            expected.add(f"{target}.{shard}.{kind}")
            break
        else:
            if tensor in params:
                assert tuple(params[tensor].shape) == shape, tensor
                expected.add(tensor)
    assert {n for n in model._expected_weight_names() if ".mlp." not in n} == expected - {
        n for n in expected if ".mlp." in n}
    assert model.spec.native_reason() == "attention sinks"


def test_native_decoder_refuses_gpt_oss_by_name():
    from rooflm.model.presets import get_preset
    from rooflm.model.registry import model_spec
    spec = model_spec(get_preset("gpt-oss-20b"))
    assert spec.native_reason() == "attention sinks" and not spec.llama_layers


def test_preset_config_json_reads_in_transformers_alike():
    """The gpt-oss-20b preset written as config.json (model/hf_config.py): transformers reads the
    same shape, the same YaRN frequencies and attention factor, the same window pattern."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from rooflm.layers.rotary import yarn_attention_factor, yarn_inv_freq
    from rooflm.model.hf_config import hf_config_dict
    from rooflm.model.presets import get_preset
    preset = get_preset("gpt-oss-20b")
    hf = transformers.AutoConfig.for_model(**hf_config_dict(preset))
    assert isinstance(hf, transformers.GptOssConfig)
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.sliding_window, hf.attention_bias) == (32, 4, 128, True)
    assert tuple(hf.layer_types) == preset.layer_types
    inv_freq, factor = _compute_yarn_parameters(hf)
    torch.testing.assert_close(yarn_inv_freq(64, preset.rope_theta, preset.rope_scaling), inv_freq, rtol=0, atol=0)
    assert yarn_attention_factor(preset.rope_scaling) == pytest.approx(factor, rel=1e-12)


def test_tp2_gives_the_tokens_of_tp1(tiny):
    """Tensor parallelism on the CPU (gloo): each rank holds its heads' sinks and the o_proj bias is
    added once, after the all-reduce (also in the one-token path); the experts split as any MoE's."""
    path, _ = tiny
    prompts = [[5, 9, 33, 7, 81, 12], list(range(30, 50))]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = []
    for tp in (1, 2):
        llm = LLM(model=path, tensor_parallel_size=tp, dtype="float32", device="cpu", block_size=4)
        try:
            runs.append(llm.generate(prompts, greedy))
        finally:
            llm.shutdown()
    one, two = runs
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    for a, b in zip(one, two):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, entry in lp_a.items():
                assert abs(entry.logprob - lp_b[tok].logprob) < 1e-4


# ---- the one-token paths keep o_proj's bias ----------------------------------------------------

def _gpt_oss_layer(gemv=None):
    from rooflm.config import ModelConfig
    from rooflm.layers.kernels import Kernels
    from rooflm.model.decoder import DecoderLayer
    from rooflm.model.gpt_oss import spec
    from rooflm.model.spec import MOE
    cfg = ModelConfig(architecture="GptOssForCausalLM", vocab_size=120, hidden_size=16, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      attention_bias=True, o_proj_bias=True, attention_sinks=True, moe_bias=True,
                      num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, spec(cfg), None, None, None, Kernels(gemv=gemv), mlp=MOE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    layer.self_attn.attend = lambda positions, qkv, kv_cache, meta: torch.tanh(qkv[:, :16])
    return layer


def test_gemv_chain_adds_the_o_proj_bias():
    from rooflm.kernels.gemv import gemv_ref
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    h, r = _gpt_oss_layer()(None, x, residual, None, None)
    plain = h + r
    layer = _gpt_oss_layer(gemv_ref)
    h, none = layer(None, x, residual, None, None)
    assert none is None
    torch.testing.assert_close(h, plain, rtol=1e-5, atol=1e-5)
    without = _gpt_oss_layer(gemv_ref)
    without.self_attn.o_proj.bias.data.zero_()
    assert not torch.allclose(without(None, x, residual, None, None)[0], plain, atol=1e-3)


def test_folded_quantized_attention_keeps_the_o_proj_bias():
    """A linear with a bias does not fold (Linear.forward_folded): gpt-oss's one-token quantized
    path takes the plain layer, bias included."""
    from tests.models.test_decoder_paths import Folding
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    layer = _gpt_oss_layer()
    h, r = layer(None, x, residual, None, None)
    plain = h + r
    attn = layer.self_attn
    for lin in (attn.qkv_proj, attn.o_proj):
        lin.quant = Folding(lin.weight.detach().clone())
    h, r = layer(None, x, residual, None, None)
    torch.testing.assert_close(h + r if r is not None else h, plain, rtol=1e-5, atol=1e-5)
    assert attn.o_proj.quant.calls == []  # nothing folded
