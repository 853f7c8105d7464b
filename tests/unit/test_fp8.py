"""FP8 W8A8 on the CPU (rooflm/quant/fp8.py, kernels/fp8_quant.py): the per-token quantizer is
torch's e4m3 cast, the linear is the hand-computed scaled product, `--quantization fp8` runs the
model, and fp8 checkpoints (rooflm quantize --scheme fp8, vLLM fp8 per-tensor static) load to
the same logits as the model that wrote them."""

import json
import os

import pytest
import torch

from rooflm.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, per_token_fp8, per_token_fp8_ref
from rooflm.quant.formats import Fp8Weight
from rooflm.quant.fp8 import quantize_fp8_weight
from rooflm.quant.linear_method import Fp8Linear

PROMPTS = [[5, 9, 17, 33, 2, 71, 14, 88], [7, 3, 120, 44]]


def test_per_token_quant_is_torchs_e4m3_cast():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g) * torch.tensor([0.01, 1, 10, 300, 1e4, 0])[:, None]
    q, s = per_token_fp8(x)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1) and s.dtype == torch.float32
    expected_scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1 / (448 * 512))
    assert torch.equal(s, expected_scale)
    # Each code is torch's own round-to-nearest-even cast of x / s; each row's max hits 448.
    assert torch.equal(q.view(torch.uint8), (x / expected_scale).to(FP8_DTYPE).view(torch.uint8))
    assert torch.all(q[:5].float().abs().amax(dim=1) == FP8_MAX)
    assert torch.all(q[5].float() == 0)  # a zero row stays zero (floored scale, no 0/0)
    # The relative error of e4m3 (3 mantissa bits): at most 2^-4 of each value, away from subnormals.
    big = (x.abs() > 1e-2 * x.abs().amax(dim=1, keepdim=True))
    rel = ((q.float() * s - x).abs() / x.abs())[big]
    assert rel.max() <= 2 ** -4 + 1e-6
    assert torch.equal(per_token_fp8_ref(x.to(torch.bfloat16))[1],
                       (x.to(torch.bfloat16).float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1 / (448 * 512)))


def test_fp8_linear_matches_a_hand_computation():
    """y[m, n] = sx[m] sw[n] sum_k qx[m, k] qw[n, k], with the codes decoded by hand from their
    e4m3 bits (sign, 4-bit exponent with bias 7, 3-bit mantissa)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 32, generator=g) * 0.1
    x = torch.randn(3, 32, generator=g)
    weight = quantize_fp8_weight(w)
    assert torch.equal(weight.scales, w.abs().amax(dim=1) / FP8_MAX)
    lin = Fp8Linear(weight, torch.device("cpu"))
    assert not lin.use_scaled_mm and lin.weight_bytes() == 24 * 32 + 24 * 4

    def decode(codes: torch.Tensor) -> torch.Tensor:
        bits = codes.view(torch.uint8).to(torch.int64)
        sign = torch.where(bits >> 7 == 1, -1.0, 1.0)
        exp, man = (bits >> 3) & 0xF, bits & 0x7
        normal = (1 + man / 8.0) * torch.pow(2.0, exp.double() - 7)
        sub = (man / 8.0) * 2.0 ** -6
        return sign * torch.where(exp == 0, sub, normal)

    qx, sx = per_token_fp8(x)
    expected = (decode(qx) @ decode(weight.codes).T) * sx.double() * weight.scales.double()[None, :]
    y = lin(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6)
    # The W8A8 error against the float product: a few e4m3 steps, far from zero.
    rel = ((y - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert 1e-3 < rel < 0.1


def test_fp8_shards_fuse_with_the_largest_static_input_scale():
    a = Fp8Weight(torch.zeros(2, 16, dtype=FP8_DTYPE), torch.ones(2), "static", torch.tensor(0.5))
    b = Fp8Weight(torch.zeros(3, 16, dtype=FP8_DTYPE), torch.ones(3) * 2, "static", torch.tensor(0.75))
    fused = Fp8Weight.cat([a, b])
    assert fused.shape == (5, 16) and float(fused.input_scale) == 0.75
    with pytest.raises(ValueError, match="different activation schemes"):
        Fp8Weight.cat([a, Fp8Weight(torch.zeros(1, 16, dtype=FP8_DTYPE), torch.ones(1))])


def _llm(path, **kw):
    from rooflm.llm import LLM
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, enable_prefix_caching=False, **kw)


def _prompt_logprobs(llm) -> torch.Tensor:
    from rooflm.sampling_params import SamplingParams
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    return torch.tensor([entry[token].logprob for o, prompt in zip(out, PROMPTS)
                         for entry, token in zip(o.prompt_logprobs[1:], prompt[1:])])


def test_quantization_fp8_at_load_runs_w8a8(tmp_path):
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "qwen2")  # q/k/v biases ride beside the fp8 product
    llm = _llm(src, quantization="fp8")
    model = llm.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, Fp8Linear) and model.lm_head.quant is None
    assert llm.engine.info.matmul_dtype == "fp8"
    assert abs(llm.engine.info.weight_dtype_bytes - 1.0) < 0.1
    fp8 = _prompt_logprobs(llm)
    ref = _prompt_logprobs(_llm(src, quantization="none"))
    assert not torch.equal(fp8, ref) and (fp8 - ref).abs().max() < 0.5


def test_fp8_checkpoint_round_trip_gives_the_same_logits(tmp_path):
    """quantize --scheme fp8 writes compressed-tensors; loading it gives the logits of the model
    quantized at load (same codes, same scales, same per-token activations)."""
    from rooflm.quant.fp8 import compressed_tensors_config
    from rooflm.quantize.quantize import fp8_state_dict, write_checkpoint
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    tensors = fp8_state_dict(_llm(src, quantization="none").engine.runner.model, torch.float32)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].dtype == FP8_DTYPE
    assert tensors["model.layers.0.mlp.up_proj.weight_scale"].shape[1] == 1
    out = tmp_path / "fp8"
    write_checkpoint(str(out), json.load(open(os.path.join(src, "config.json"))), tensors, None, torch.float32,
                     quant_config=compressed_tensors_config())
    loaded = _llm(str(out))
    assert isinstance(loaded.engine.runner.model.model.layers[1].mlp.down_proj.quant, Fp8Linear)
    assert torch.equal(_prompt_logprobs(loaded), _prompt_logprobs(_llm(src, quantization="fp8")))


def test_kv_scales_calibrate_to_the_largest_per_token_scale_and_load_back(tmp_path):
    """quantize --scheme fp8 --kv-cache-scales: each layer's static K/V scale is the largest of the
    per-token scales an FP8 cache stores for the same windows (max |rotated K| or |V| / 448), and
    the checkpoint it writes loads them into the cache (compressed-tensors kv_cache_scheme)."""
    from rooflm.quant.fp8 import compressed_tensors_config
    from rooflm.quantize.kv_scales import KV_CACHE_SCHEME, calibrate_kv_scales, kv_scale_tensors
    from rooflm.quantize.quantize import fp8_state_dict, write_checkpoint
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    llm = _llm(src, quantization="none", kv_cache_dtype="fp8", kv_cache_scales="per-token", num_blocks=64)
    windows = [list(range(1, 40)), list(range(50, 90)), [7, 3, 9] * 10]
    scales = calibrate_kv_scales(llm, windows)  # its prefill fills the per-token pool too
    pool = llm.engine.runner.kv_scales  # [layers, 2, blocks, block_size, H_kv]
    torch.testing.assert_close(scales, pool.amax(dim=(2, 3, 4)), rtol=1e-5, atol=0)
    tensors = fp8_state_dict(llm.engine.runner.model, torch.float32) | kv_scale_tensors(scales)
    assert tensors["model.layers.1.self_attn.v_scale"].shape == ()
    config = compressed_tensors_config() | {"kv_cache_scheme": dict(KV_CACHE_SCHEME)}
    out = tmp_path / "fp8-kv"
    write_checkpoint(str(out), json.load(open(os.path.join(src, "config.json"))), tensors, None, torch.float32,
                     quant_config=config)
    runner = _llm(str(out), kv_cache_dtype="fp8").engine.runner
    assert runner.kv_scale_mode() == "static"
    torch.testing.assert_close(runner.kv_scales[:, :, 0], scales)


def write_vllm_fp8_static(tmp_path, src: str, input_scale: float = 0.05):
    """A copy of the float model at `src` in vLLM's "fp8" layout: per-tensor weight scales and one
    static input scale for every linear. Returns (directory, its config.json as a dict)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]:
        w = tensors[name].float()
        scale = w.abs().max() / FP8_MAX
        tensors[name] = (w / scale).to(FP8_DTYPE)
        tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(())
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor(input_scale)
    out = tmp_path / "vllm-fp8"
    os.makedirs(out)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    json.dump(cfg, open(out / "config.json", "w"))
    return out, cfg


def test_vllm_fp8_static_per_tensor_checkpoint_loads(tmp_path):
    """vLLM's "fp8" layout with per-tensor weight scales and static input scales: the fused q/k/v
    take the largest input scale, and every linear multiplies what the file holds."""
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    out, cfg = write_vllm_fp8_static(tmp_path, src)
    llm = _llm(str(out))
    lin = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant
    assert lin.activations == "static" and float(lin.input_scale) == pytest.approx(0.05)
    assert torch.isfinite(_prompt_logprobs(llm)).all()
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    json.dump(cfg, open(out / "config.json", "w"))
    from rooflm.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="weight_block_size"):
        _llm(str(out))


def test_kv_cache_scales_need_the_fp8_scheme(tmp_path, capsys):
    from rooflm.cli import main
    try:
        rc = main(["quantize", "--scheme", "int4-g128", "--kv-cache-scales", "--output", str(tmp_path / "x")])
    except ValueError as exc:
        message = str(exc)
    else:
        assert rc != 0
        message = capsys.readouterr().err
    assert "--kv-cache-scales" in message and "--scheme fp8" in message
    assert not (tmp_path / "x").exists()


def test_layers_pass_codes_from_the_norms_and_silu_mul_to_the_fp8_linears(tmp_path, monkeypatch):
    """DecoderLayer._forward_fp8: the norms and SiLU-mul quantize their own output
    (kernels/norm_act_fp8.py) and qkv, gate_up and down take the codes. The codes are the unfused
    path's exactly, so the logits are too (here the fp32 emulation stands in for _scaled_mm, which
    the CPU lacks; tests/kernels/test_norm_act_fp8.py checks the kernels bit for bit on the GPU)."""
    from rooflm.kernels import norm_act_fp8
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "qwen2")  # biases: forward_fp8 adds them after the product
    llm = _llm(src, quantization="fp8")
    apart = _prompt_logprobs(llm)
    calls = []
    for name in ("rmsnorm_fp8", "silu_mul_fp8"):
        real = getattr(norm_act_fp8, name)
        monkeypatch.setattr(norm_act_fp8, name, lambda *a, _real=real, _n=name, **k: (calls.append(_n), _real(*a, **k))[1])
    monkeypatch.setattr(Fp8Linear, "takes_fp8_input", True)
    fused = _prompt_logprobs(llm)
    layers = len(llm.engine.runner.model.model.layers)
    assert calls.count("rmsnorm_fp8") >= 2 * layers and calls.count("silu_mul_fp8") >= layers
    assert torch.equal(fused, apart)
