"""Mixture-of-experts families end to end against HF transformers (fp32, CPU): Qwen3-MoE (with a
dense layer between sparse ones), Mixtral, OLMoE and Qwen2-MoE (shared expert), each a tiny random
checkpoint saved by transformers under the Hub's per-expert names and run through rooflm's engine.
Greedy tokens equal to HF's, logprobs within 1e-3; the loader takes every tensor and misses none;
the dummy-weight path round-trips through the same names."""

import os

import pytest
import torch

from rooflm import LLM, SamplingParams
from rooflm.layers.moe import SparseMoeBlock
from rooflm.model.registry import get_model_class
from tests.models.test_hf_parity import assert_close_to_hf, hf_greedy
from tests.models.tiny_models import TINY_SHAPE, _randomize_norms_and_biases

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24

# family -> (config class, fields beyond the tiny shape); 4 experts, top-2, hidden 64.
MOE_FAMILIES = {
    # 3 layers, the middle one dense (mlp_only_layers): HF's rule for which layers are sparse.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=32, head_dim=32,
                                         norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=48, sliding_window=None)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, intermediate_size=48, norm_topk_prob=False)),
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; a gated shared expert.
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=False,
                                         shared_expert_intermediate_size=48, num_hidden_layers=4,
                                         decoder_sparse_step=2)),
}


def make_tiny_moe(root, family: str, seed: int = 0, **overrides):
    """(checkpoint directory, HF model) of a tiny random MoE model, fp32, eager experts."""
    name, fields = MOE_FAMILIES[family]
    config = getattr(transformers, name)(**{**TINY_SHAPE, "num_key_value_heads": 2, "num_experts_per_tok": 2,
                                             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                             "initializer_range": 0.3, "experts_implementation": "eager",
                                             **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize_norms_and_biases(model, torch.Generator().manual_seed(seed + 1))
    model = model.float().eval()
    path = os.path.join(os.fspath(root), f"{family}-seed{seed}")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_tiny_moe_family_greedy_matches_hf(tmp_path, family):
    path, hf_model = make_tiny_moe(tmp_path, family)
    prompts = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 60))]
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_close_to_hf(out, tokens, logprobs)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_layers_follow_the_config(tmp_path, family):
    """The sparse layers are HF's, and every checkpoint tensor loads where HF has it."""
    path, hf_model = make_tiny_moe(tmp_path, family)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    model = llm.engine.runner.model
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    hf = ["Sparse" in type(layer.mlp).__name__ for layer in hf_model.model.layers]
    assert ours == hf and any(ours) and (family in ("mixtral", "olmoe") or not all(ours))
    hf_layer = next(i for i, sparse in enumerate(hf) if sparse)
    hf_block = hf_model.model.layers[hf_layer].mlp
    block = model.model.layers[hf_layer].mlp
    torch.testing.assert_close(block.router.weight, hf_block.gate.weight, rtol=0, atol=0)
    torch.testing.assert_close(block.experts.w13, hf_block.experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(block.experts.w2, hf_block.experts.down_proj, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_loader_names_every_moe_tensor(tmp_path, family):
    """A checkpoint without one expert's tensor is refused, naming it; an extra tensor too."""
    from safetensors.torch import load_file, save_file

    from rooflm.errors import ModelLoadError
    path, _ = make_tiny_moe(tmp_path, family)
    file = os.path.join(path, "model.safetensors")
    state = {name: t.clone() for name, t in load_file(file).items()}
    victim = next(n for n in state if n.endswith(("experts.1.down_proj.weight", "experts.1.w2.weight")))
    save_file({k: v for k, v in state.items() if k != victim}, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing 1 weight"):
        LLM(model=path, dtype="float32", device="cpu", block_size=4)
    extra = victim.replace("experts.1.", "experts.9.")
    save_file({**state, extra: state[victim].clone()}, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        LLM(model=path, dtype="float32", device="cpu", block_size=4)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_dummy_weights_load_back_into_the_model(tmp_path, family):
    """dummy_weights yields the per-expert checkpoint names; load_weights takes them back,
    nothing missing, and the model equals init_dummy_weights' draws."""
    from rooflm.model.loader import load_model_config, weight_shapes
    path, _ = make_tiny_moe(tmp_path, family)
    cfg = load_model_config(path, "safetensors")
    model_class = get_model_class(cfg.architecture)
    drawn = model_class(cfg, max_positions=64)
    drawn.init_dummy_weights(seed=3)
    tensors = dict(drawn.dummy_weights(seed=3))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == weight_shapes(cfg)
    loaded = model_class(cfg, max_positions=64)
    for p in loaded.parameters():
        p.data.fill_(float("nan"))
    loaded.load_weights(tensors.items())
    for (name, a), b in zip(drawn.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    victim = next(n for n in tensors if n.endswith(("experts.2.up_proj.weight", "experts.2.w3.weight")))
    piece = victim.split(".experts.")[0].replace("block_sparse_moe", "mlp") + ".experts.2.up"
    with pytest.raises(ValueError, match=rf"missing 1 tensors, e.g. \['{piece}'\]"):
        model_class(cfg, max_positions=64).load_weights((n, t) for n, t in tensors.items() if n != victim)


# ---- the decoder's fast paths fall back for the MoE part, keep the attention half's --------

def _moe_layer(spec_name: str, gemv=None):
    from rooflm.config import ModelConfig
    from rooflm.layers.kernels import Kernels
    from rooflm.model.decoder import DecoderLayer
    from rooflm.model.spec import MOE, QK_NORM_PROJ, ModelSpec, moe_parts
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=120, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True)
    extra = dict(qk_norm=QK_NORM_PROJ) if spec_name == "olmoe" else {}
    spec = ModelSpec(**extra, **moe_parts(cfg))
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, spec, None, None, None, Kernels(gemv=gemv), mlp=MOE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    layer.self_attn.attend = lambda positions, qkv, kv_cache, meta: torch.tanh(qkv[:, :16])
    return layer


@pytest.mark.parametrize("spec_name", ["qwen3_moe", "olmoe"])
def test_gemv_chain_runs_the_moe_block_apart(spec_name):
    from rooflm.kernels.gemv import gemv_ref
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    h, r = _moe_layer(spec_name)(None, x, residual, None, None)
    plain = h + r
    calls = []

    def recording_gemv(x, weight, **kw):
        calls.append(tuple(weight.shape))
        return gemv_ref(x, weight, **kw)
    layer = _moe_layer(spec_name, recording_gemv)
    h, none = layer(None, x, residual, None, None)
    assert none is None
    torch.testing.assert_close(h, plain, rtol=1e-5, atol=1e-5)
    assert calls == [(32, 16), (16, 16)]  # qkv and o_proj as GEMVs; the experts are not linears


def test_folded_quantized_attention_beside_an_moe_block():
    from tests.models.test_decoder_paths import Folding
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    layer = _moe_layer("qwen3_moe")
    h, r = layer(None, x, residual, None, None)
    plain = h + r
    attn = layer.self_attn
    for lin in (attn.qkv_proj, attn.o_proj):
        lin.quant = Folding(lin.weight.detach().clone())
    h, none = layer(None, x, residual, None, None)
    assert none is None
    torch.testing.assert_close(h, plain, rtol=1e-5, atol=1e-5)
    assert [attn.qkv_proj.quant.calls, attn.o_proj.quant.calls] == [[(True, False, False)], [(False, True, False)]]
