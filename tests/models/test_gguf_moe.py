"""Mixture-of-experts GGUF files (Qwen3-MoE as llama.cpp's "qwen3moe", Qwen2-MoE as "qwen2moe" with
its shared expert, OLMoE as "olmoe", Mixtral as a "llama" with llama.expert_count), written here the
way convert_hf_to_gguf.py lays them out: the router as
blk.N.ffn_gate_inp, every expert's gate / up / down stacked into blk.N.ffn_{gate,up,down}_exps
[E, rows, cols], expert_count / expert_used_count / expert_feed_forward_length, Mixtral's q/k
permuted. The tiny HF models' weights are first rounded to the file's storage (Q4_0, Q8_0, F16), so the
file and the safetensors checkpoint hold the same model: loaded from the GGUF, rooflm must read the
safetensors config and weights exactly, and give the same greedy tokens and logprobs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rooflm.model.loader import iter_weights, load_model_config
from tests.models.test_gguf_families import (_add, _generate, _text_model_metadata, assert_same_config,
                                             llama_cpp_permute, storage_roundtrip)
from tests.models.test_moe_parity import make_tiny_moe
from tests.unit.test_gguf_formats import _word_level_tokenizer

gguf = pytest.importorskip("gguf")

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe", "qwen2_moe": "qwen2moe"}


def _rounded_model(root, family: str, fmt: str, **overrides):
    """(safetensors directory, HF model) with the decoder layers' matrices (experts included, one
    [rows, cols] matrix at a time) rounded as `fmt` stores them, the rest as F16."""
    _, model = make_tiny_moe(root, family, **overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            layer_fmt = fmt if name.startswith("model.layers.") else "F16"
            flat = param.reshape(-1, param.shape[-1]).numpy()
            param.copy_(torch.from_numpy(storage_roundtrip(flat, layer_fmt)).reshape(param.shape))
    path = os.path.join(os.fspath(root), f"{family}-{fmt}")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def write_moe_gguf(path: str, hf_model, family: str, fmt: str) -> None:
    cfg = hf_model.config
    arch = GGUF_ARCH[family]
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        cfg.num_hidden_layers)
    # gguf-py's qwen3moe lists no dense FFN (every released Qwen3-MoE layer is sparse): the dense
    # layer of the tiny model takes the Llama names, which rooflm's loader reads in any family.
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    _text_model_metadata(w, cfg, write_swa_base=False)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if family in ("qwen3_moe", "qwen2_moe"):  # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:  # LlamaModel: the vocabulary and the rotated width
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for hf_name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy().copy()
        module, suffix = hf_name.rsplit(".", 1)
        layer_fmt = fmt if hf_name.startswith("model.layers.") else "F16"
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: the converter stacks gate and up apart
            block = name_map.get_name(hf_name.rsplit(".mlp.", 1)[0] + ".mlp.gate").replace("ffn_gate_inp", "")
            inter = array.shape[1] // 2
            _add(w, f"{block}ffn_gate_exps.weight", np.ascontiguousarray(array[:, :inter]), layer_fmt)
            _add(w, f"{block}ffn_up_exps.weight", np.ascontiguousarray(array[:, inter:]), layer_fmt)
            continue
        if hf_name.endswith("experts.down_proj"):
            block = name_map.get_name(hf_name.rsplit(".mlp.", 1)[0] + ".mlp.gate").replace("ffn_gate_inp", "")
            _add(w, f"{block}ffn_down_exps.weight", array, layer_fmt)
            continue
        if family == "mixtral" and module.endswith("q_proj"):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif family == "mixtral" and module.endswith("k_proj"):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if module.endswith("mlp.gate"):  # the router: F32, like the converter's small tensors
            layer_fmt = "F32"
        _add(w, f"{name_map.get_name(module) or dense_map.get_name(module)}.{suffix}", array, layer_fmt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Qwen3-MoE's layer 1 is dense (mlp_only_layers=[1]): no router tensor there.
VARIANTS = [("qwen3_moe", "Q4_0", {}), ("mixtral", "Q8_0", dict(intermediate_size=64)),
            ("olmoe", "F16", {}),
            # layers 1 and 3 sparse (decoder_sparse_step 2), a gated shared expert beside the experts
            ("qwen2_moe", "Q8_0", dict(moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                       intermediate_size=64))]


@pytest.mark.parametrize("family,fmt,overrides", VARIANTS, ids=[f"{f}-{q}" for f, q, _ in VARIANTS])
def test_moe_gguf_is_the_safetensors_model(tmp_path, family, fmt, overrides):
    path, hf_model = _rounded_model(tmp_path, family, fmt, **overrides)
    gguf_path = str(tmp_path / f"{family}.gguf")
    write_moe_gguf(gguf_path, hf_model, family, fmt)

    config = load_model_config(gguf_path, "gguf")
    assert config.architecture == hf_model.config.architectures[0]
    assert_same_config(config, load_model_config(path, "safetensors"))
    ours = dict(iter_weights(gguf_path, "gguf"))
    theirs = {n: t.load() if hasattr(t, "load") else t for n, t in iter_weights(path, "safetensors")}
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name].float()), name

    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer")
    from_gguf = _generate(gguf_path, tokenizer, quantization="none")
    from_safetensors = _generate(path, tokenizer)
    for ours_out, theirs_out in zip(from_gguf, from_safetensors):
        assert ours_out.outputs[0].token_ids == theirs_out.outputs[0].token_ids
        for a, b in zip(ours_out.outputs[0].logprobs, theirs_out.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in a.items()} == pytest.approx(
                {t: lp.logprob for t, lp in b.items()}, abs=1e-5)


def test_a_llama_gguf_with_experts_of_an_unknown_family_is_refused(tmp_path):
    """An architecture string rooflm reads only dense (qwen2 here) with expert_count: named."""
    from rooflm.errors import ModelLoadError

    path = str(tmp_path / "x.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'qwen2' with 4 experts"):
        load_model_config(path, "gguf")
