"""The engine with an FP8 KV cache (--kv-cache-dtype fp8) on the CPU: scales travel with their
blocks through swaps, recompute and prefix hits; outputs stay close to the full-precision cache."""

import pytest
import torch

from rooflm import LLM, SamplingParams, envs
from tests.models.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny-fp8"), "llama", initializer_range=0.3)
    return path


def prompts_of(lengths):
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def fp8_llm(path, **kwargs):
    return LLM(model=path, device="cpu", dtype="float32", block_size=4, kv_cache_dtype="fp8", **kwargs)


def test_fp8_pool_layout_and_bytes(tiny_path):
    llm = fp8_llm(tiny_path, num_blocks=64)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_scales.shape == runner.kv_cache.shape[:-1] and runner.kv_scales.dtype == torch.float32
    head_dim = llm.engine.model_config.head_dim
    # One byte per element plus a 4-byte scale per head vector, against fp32's 4 bytes.
    assert llm.engine.info.kv_dtype_bytes == pytest.approx(1 + 4 / head_dim)
    full = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4, num_blocks=64).engine.runner
    assert runner.kv_bytes_per_block() / full.kv_bytes_per_block() == pytest.approx((1 + 4 / head_dim) / 4)
    assert llm.engine.info.kv_cache_dtype == "fp8"


def test_fp8_preemption_by_swap_and_recompute_matches_ample_pool(tiny_path):
    lengths = [37, 21, 50, 9, 44, 30, 17, 26, 33, 12]
    prompts = prompts_of(lengths)
    ref = tokens(fp8_llm(tiny_path, num_blocks=512).generate(prompts, GREEDY))
    need = sum(-(-(n + GREEDY.max_tokens) // 4) for n in lengths)
    for mode in ("swap", "recompute"):
        small = fp8_llm(tiny_path, num_blocks=need // 6, preemption_mode=mode, reserve_new_tokens=False)
        assert tokens(small.generate(prompts, GREEDY)) == ref, mode
        assert small.engine.scheduler.num_preemptions > 0


def test_fp8_prefix_hit_gives_same_tokens(tiny_path):
    llm = fp8_llm(tiny_path)
    prompt = prompts_of([40])[0]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 36
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_fp8_outputs_stay_close_to_the_full_precision_cache(tiny_path):
    prompts = prompts_of([37, 21, 50, 9, 44, 30, 17, 26])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    full = LLM(model=tiny_path, device="cpu", dtype="float32", block_size=4).generate(prompts, params)
    fp8 = fp8_llm(tiny_path).generate(prompts, params)
    first_tokens = [a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(full, fp8)]
    assert sum(first_tokens) >= 7  # the first token sees the prompt's K/V only through the cache
    # The chosen token's logprob under each cache, where both chose the same one.
    diffs = []
    for a, b in zip(full, fp8):
        for tok_a, tok_b, lp_a, lp_b in zip(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                            a.outputs[0].logprobs, b.outputs[0].logprobs):
            if tok_a != tok_b:
                break
            diffs.append(abs(lp_a[tok_a].logprob - lp_b[tok_b].logprob))
    # This random model's attention is peaky (initializer 0.3), so E4M3's 3 mantissa bits move
    # its logprobs by ~0.14 on average; a misapplied scale moves them by whole units. (SmolLM2's
    # real weights, 4 prompts x 24 tokens: 0.037 mean, 0.15 max.)
    mean = sum(diffs) / len(diffs)
    assert len(diffs) >= 32 and mean < 0.3, (len(diffs), mean, max(diffs))


def test_bad_kv_cache_dtype_names_the_choices(tiny_path):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3"):
        LLM(model=tiny_path, device="cpu", kv_cache_dtype="int4")


# ---- static scales (--kv-cache-scales static, or a checkpoint's kv_cache_scheme) ----------------

def test_static_scales_pool_layout_and_bytes(tiny_path):
    llm = fp8_llm(tiny_path, num_blocks=64, kv_cache_scales="static")
    runner = llm.engine.runner
    cfg = llm.engine.model_config
    assert runner.kv_scale_mode() == "static"
    assert runner.kv_scales.shape == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads)
    assert runner.kv_scales.eq(1.0).all()  # no checkpoint scales: vLLM's 1.0
    assert llm.engine.info.kv_dtype_bytes == 1.0  # no per-token scale in the pool


def test_static_scales_preemption_and_prefix_hits_match_ample_pool(tiny_path):
    lengths = [37, 21, 50, 9, 44, 30, 17, 26, 33, 12]
    prompts = prompts_of(lengths)
    ref = tokens(fp8_llm(tiny_path, num_blocks=512, kv_cache_scales="static").generate(prompts, GREEDY))
    need = sum(-(-(n + GREEDY.max_tokens) // 4) for n in lengths)
    small = fp8_llm(tiny_path, num_blocks=need // 6, preemption_mode="swap", reserve_new_tokens=False,
                    kv_cache_scales="static")
    assert tokens(small.generate(prompts, GREEDY)) == ref
    assert small.engine.scheduler.num_preemptions > 0
    ample = fp8_llm(tiny_path, kv_cache_scales="static")
    first, second = (ample.generate([prompts[2]], GREEDY)[0] for _ in range(2))
    assert second.num_cached_tokens == 48 and second.outputs[0].token_ids == first.outputs[0].token_ids


def _with_kv_scales(src, dst, scales, scheme=None):
    """A copy of the tiny checkpoint carrying static K/V scales, as llm-compressor writes them."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    for layer, (k, v) in enumerate(scales):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.load(open(f"{dst}/config.json"))
    config["quantization_config"]["kv_cache_scheme"] = scheme or {
        "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
    json.dump(config, open(f"{dst}/config.json", "w"))
    return dst


def _fp8_weights_copy(src, dst):
    """The tiny checkpoint with fp8 per-channel weights in compressed-tensors' float-quantized
    format (llm-compressor's FP8 recipe; the K/V scheme rides on a weight scheme)."""
    import json

    from safetensors.torch import load_file, save_file

    from rooflm.kernels.fp8_quant import FP8_DTYPE, FP8_MAX
    tensors = load_file(f"{src}/model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            scale = t.abs().amax(1, keepdim=True) / FP8_MAX
            out[name] = (t / scale).to(FP8_DTYPE)
            out[name[: -len("weight")] + "weight_scale"] = scale
        else:
            out[name] = t
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.load(open(f"{src}/config.json"))
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "type": "float", "num_bits": 8, "strategy": "channel"}, "input_activations": None}}}
    json.dump(config, open(f"{dst}/config.json", "w"))


def test_checkpoint_kv_scales_reach_the_cache_and_generate(tiny_path, tmp_path):
    layers = 2
    base = tmp_path / "fp8"
    import shutil
    shutil.copytree(tiny_path, base)
    _fp8_weights_copy(base, base)
    prompts = prompts_of([37, 21, 50, 9])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Calibrated as llm-compressor does: each layer's largest |K| and |V| over the prompts / 448,
    # here the largest of the per-token scales a run leaves in the pool.
    per_token_llm = fp8_llm(str(base), kv_cache_scales="per-token")
    per_token = tokens(per_token_llm.generate(prompts, params))
    calibrated = per_token_llm.engine.runner.kv_scales.amax(dim=(2, 3, 4))
    assert calibrated.shape == (layers, 2) and (calibrated > 0).all()
    scales = calibrated.tolist()
    path = _with_kv_scales(base, tmp_path / "fp8-kv", scales)
    llm = fp8_llm(str(path))  # --kv-cache-scales auto: the checkpoint's
    runner = llm.engine.runner
    assert runner.kv_scale_mode() == "static"
    want = torch.tensor(scales)[:, :, None].expand_as(runner.kv_scales)
    assert torch.equal(runner.kv_scales.cpu(), want)
    static = tokens(llm.generate(prompts, params))
    same_first = sum(a[0] == b[0] for a, b in zip(static, per_token))
    assert same_first >= 3, (static, per_token)
    # A bf16/fp32 cache ignores the scales.
    full = LLM(model=str(path), device="cpu", dtype="float32", block_size=4)
    assert full.engine.runner.kv_scale_mode() == "" and full.engine.runner.kv_scales is None


def test_checkpoint_kv_scheme_errors_name_the_problem(tiny_path, tmp_path):
    from rooflm.errors import ModelLoadError

    base = tmp_path / "fp8"
    import shutil
    shutil.copytree(tiny_path, base)
    _fp8_weights_copy(base, base)
    dynamic = _with_kv_scales(base, tmp_path / "dyn", [(0.1, 0.1)] * 2,
                              {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": True})
    with pytest.raises(ModelLoadError, match="kv_cache_scheme .* is not supported"):
        fp8_llm(str(dynamic))
    one_layer = _with_kv_scales(base, tmp_path / "partial", [(0.1, 0.1)])
    with pytest.raises(ModelLoadError, match="missing 2 weight"):
        fp8_llm(str(one_layer))
    zero = _with_kv_scales(base, tmp_path / "zero", [(0.0, 0.1), (0.1, 0.1)])
    with pytest.raises(ValueError, match="must be positive and finite"):
        fp8_llm(str(zero))


def test_bad_kv_cache_scales_names_the_choices(tiny_path):
    with pytest.raises(ValueError, match="kv_cache_scales must be auto, per-token or static"):
        LLM(model=tiny_path, device="cpu", kv_cache_dtype="fp8", kv_cache_scales="per-block")


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["per-token", "static"])
def test_gpu_fp8_cache_matches_the_cpu_reference(tiny_path, scales):
    """The Triton kernels (RoPE + FP8 write, decode, prefill) on the GPU against the CPU's torch
    reference with the same cache format: same first tokens, close logprobs."""
    prompts = prompts_of([37, 21, 50, 9, 44, 30, 17, 26])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    cpu = fp8_llm(tiny_path, kv_cache_scales=scales).generate(prompts, params)
    gpu = LLM(model=tiny_path, device="cuda", dtype="float16", block_size=16, num_blocks=256,
              kv_cache_dtype="fp8", kv_cache_scales=scales).generate(prompts, params)
    assert sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(cpu, gpu)) >= 7
    diffs = [abs(a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]].logprob
                 - b.outputs[0].logprobs[0][a.outputs[0].token_ids[0]].logprob)
             for a, b in zip(cpu, gpu) if a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]]
    assert sum(diffs) / len(diffs) < 0.3, diffs


@pytest.mark.gpu
def test_gpu_static_fp8_decode_on_the_cuda_kernel_matches_triton(tmp_path, monkeypatch):
    """head_dim 128 and enough sequences for one split: static FP8 decode runs on
    kernels/fp8_decode_mma.py's CUDA kernel; against the Triton kernel (ROOFLM_FP8_DECODE_MMA=0's
    path) the greedy tokens and their logprobs agree."""
    from rooflm.kernels import fp8_decode_mma

    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3, hidden_size=512, num_attention_heads=4)
    prompts = prompts_of([9 + (5 * i) % 60 for i in range(72)])  # 72 x 2 KV heads >= 132 SMs: one split
    # Two decode steps: the first reads caches both runs wrote alike (the same prefill), so the
    # kernels' rounding is all that differs.
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    launches = []
    kernel = fp8_decode_mma.fp8_decode_attention_mma
    monkeypatch.setattr(fp8_decode_mma, "fp8_decode_attention_mma",
                        lambda *a, **k: (launches.append(1), kernel(*a, **k))[1])

    def run():
        return LLM(model=path, device="cuda", dtype="bfloat16", block_size=16, num_blocks=512,
                   kv_cache_dtype="fp8", kv_cache_scales="static").generate(prompts, params)

    mma = run()
    assert launches, "the CUDA kernel never ran"
    del launches[:]
    with envs.override("ROOFLM_FP8_DECODE_MMA", "0"):
        triton = run()
    assert not launches
    # Same tokens until the kernels' rounding splits a near-tie: there the Triton run's top two hold
    # both choices, within a small logprob of each other; before it, the logprobs agree closely.
    diffs, splits = [], []
    for a, b in zip(mma, triton):
        for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            la, lb = a.outputs[0].logprobs[i], b.outputs[0].logprobs[i]
            if x != y:
                splits.append((i, x, y, {t: round(p.logprob, 4) for t, p in la.items()},
                               {t: round(p.logprob, 4) for t, p in lb.items()}))
                break
            diffs.append(abs(la[x].logprob - lb[x].logprob))
    assert all(x in lb and lb[y] - lb[x] < 0.1 for _, x, y, _, lb in splits), splits
    assert len(splits) <= 0.1 * len(prompts), splits
    assert sum(diffs) / len(diffs) < 0.01, (max(diffs), sum(diffs) / len(diffs))
