"""MXFP4 checkpoints (model/mxfp4.py): the E2M1 grid from its bit fields, the spec's packer (shared
exponent, round to nearest even, saturation) and exact round trips, the dequantizer against
transformers' own, and a tiny gpt-oss written with MXFP4 experts loading as its bf16 twin (greedy
tokens equal to HF's on the same values)."""

import json
import os

import pytest
import torch

from rooflm import LLM, SamplingParams
from rooflm.model.mxfp4 import dequantize_mxfp4, e2m1_values, pack_mxfp4
from tests.models.test_gpt_oss import make_tiny_gpt_oss
from tests.models.test_hf_parity import assert_close_to_hf, hf_greedy

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_grid():
    values = e2m1_values()
    assert values[:8].tolist() == GRID and values[8:].tolist() == [-v for v in GRID]
    assert torch.signbit(values[8])  # code 8 is -0


def representable(shape, seed=0):
    """Random MXFP4-representable values: grid values times a power of two per 32-block, each block
    holding a +-6 or +-4 (its amax sets the spec's shared exponent to exactly that power)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, shape, generator=gen)
    x = e2m1_values()[codes].reshape(*shape[:-1], -1, 32)
    x[..., 0] = torch.where(torch.rand(x.shape[:-1], generator=gen) < 0.5, 6.0, -4.0)
    power = torch.randint(-20, 20, x.shape[:-1], generator=gen).float()
    return (x * torch.exp2(power)[..., None]).reshape(shape)


@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 5, 96)])
def test_round_trip_is_exact_for_representable_values(shape):
    x = representable(shape)
    blocks, scales = pack_mxfp4(x)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (*shape[:-1], shape[-1] // 32, 16) and scales.shape == (*shape[:-1], shape[-1] // 32)
    for dtype in (torch.bfloat16, torch.float32):
        torch.testing.assert_close(dequantize_mxfp4(blocks, scales, dtype), x.to(dtype), rtol=0, atol=0)


def test_packer_rounds_to_nearest_even_and_saturates():
    # one block, amax 6 (shared scale 2^0): ties 2.5 -> 2 (even code), 5 -> 4, 0.25 -> 0, 0.75 -> 1;
    # 1.25 -> 1; 1.75 -> 2; negatives mirror.
    row = torch.tensor([6.0, 2.5, 5.0, 0.25, 0.75, 1.25, 1.75, -2.5, -5.0, 3.4] + [0.0] * 22)
    blocks, scales = pack_mxfp4(row)
    assert scales.tolist() == [127]
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got[:10].tolist() == [6.0, 2.0, 4.0, 0.0, 1.0, 1.0, 2.0, -2.0, -4.0, 3.0]
    # amax 7.9: shared exponent floor(log2 7.9) - 2 = 0, and 7.9 saturates to 6
    blocks, scales = pack_mxfp4(torch.tensor([7.9] + [1.0] * 31))
    assert scales.tolist() == [127] and dequantize_mxfp4(blocks, scales, torch.float32)[0] == 6.0
    # a block of zeros: the smallest scale, zeros back
    blocks, scales = pack_mxfp4(torch.zeros(32))
    assert scales.tolist() == [0] and dequantize_mxfp4(blocks, scales, torch.float32).abs().sum() == 0


def test_nibble_order_and_nan_scale():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x71  # element 0: code 1 (0.5), element 1: code 7 (6)
    scales = torch.tensor([128], dtype=torch.uint8)  # 2^1
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got[:2].tolist() == [1.0, 12.0] and got[2:].abs().sum() == 0
    assert torch.isnan(dequantize_mxfp4(blocks, torch.tensor([255], dtype=torch.uint8))).all()
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, torch.zeros(2, dtype=torch.uint8))


@pytest.mark.parametrize("rows_per_chunk", [4096, 7])
def test_dequantizer_matches_transformers(monkeypatch, rows_per_chunk):
    import rooflm.model.mxfp4 as ours_module
    monkeypatch.setattr(ours_module, "ROWS_PER_CHUNK", rows_per_chunk)  # 7: chunks cut through experts
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)  # [E, rows, G, 16]
    scales = torch.randint(100, 150, (3, 10, 4), generator=gen, dtype=torch.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, G * 32, rows]
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=0, atol=0)


def write_mxfp4_checkpoint(path, hf_model):
    """Round the HF model's experts to MXFP4 values in place and rewrite its checkpoint as gpt-oss's
    release stores them: [E, out, in] blocks and scales, quant_method mxfp4."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    for i, layer in enumerate(hf_model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, proj)  # [E, in, out]
            blocks, scales = pack_mxfp4(param.detach().transpose(1, 2))
            with torch.no_grad():
                param.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del state[name]
            state[name + "_blocks"], state[name + "_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(state, file, metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(config_path, "w") as f:
        json.dump(config, f)
    return state


def test_tiny_gpt_oss_with_mxfp4_experts_matches_hf(tmp_path):
    path, hf_model = make_tiny_gpt_oss(tmp_path, intermediate_size=64)  # K = 64 in both projections
    write_mxfp4_checkpoint(path, hf_model)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    model = llm.engine.runner.model
    for ours, hf in zip(model.model.layers, hf_model.model.layers):
        torch.testing.assert_close(ours.mlp.experts.w2, hf.mlp.experts.down_proj.transpose(1, 2), rtol=0, atol=0)
    prompts = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 60))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(hf_model, prompt, 16)
        assert_close_to_hf(out, tokens, logprobs)


def test_an_unpaired_mxfp4_half_is_named(tmp_path):
    from safetensors.torch import save_file

    from rooflm.errors import ModelLoadError
    path, hf_model = make_tiny_gpt_oss(tmp_path, intermediate_size=64)
    state = write_mxfp4_checkpoint(path, hf_model)
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj_blocks' has no "
                                             r"'model\.layers\.1\.mlp\.experts\.down_proj_scales'"):
        LLM(model=path, dtype="float32", device="cpu", block_size=4)
