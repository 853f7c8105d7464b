"""Quantized checkpoints on the GPU: the W4A16/W8A16 kernels (kept quantized) against the same
model with the decoded values in float (dequantize-then-float reference). Run with `pytest -m gpu`."""

import json
import os

import pytest
import torch

from rooflm import LLM, SamplingParams, envs
from rooflm.quant.rtn import WeightScheme
from tests.models.test_gpu_e2e import PROMPTS, check_greedy_close
from tests.models.tiny_models import make_tiny_model
from tests.unit.test_quant_formats import _write_quantized_copy

pytestmark = pytest.mark.gpu


def _generate(path, dtype, **kw):
    llm = LLM(model=str(path), device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=256, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5))
    linears = [m for m in llm.engine.runner.model.modules() if getattr(m, "quant", None) is not None]
    del llm
    torch.cuda.empty_cache()
    return outs, linears


@pytest.mark.parametrize("layout,scheme", [("gptq", "int4-g32"), ("awq", "int4-g64"), ("gptq", "int8"),
                                           ("ct", "int4-g32"), ("ct", "int8")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_quantized_kernels_match_dequantized_float(tmp_path, layout, scheme, dtype):
    from safetensors.torch import save_file
    src, _ = make_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    reference, cfg = _write_quantized_copy(src, str(tmp_path / "q"), layout, WeightScheme.parse(scheme))
    ref_dir = tmp_path / "ref"
    os.makedirs(ref_dir)
    save_file({k: v.contiguous() for k, v in reference.items()}, str(ref_dir / "model.safetensors"))
    cfg.pop("quantization_config")
    with open(ref_dir / "config.json", "w") as f:
        json.dump(cfg, f)
    quant, linears = _generate(tmp_path / "q", dtype)
    assert len(linears) == 2 * 4, "every decoder linear (fused) must run the quantized kernel"
    ref, _ = _generate(ref_dir, dtype)
    check_greedy_close(quant, ref)


def test_dummy_rtn_quantization_runs_with_cuda_graphs():
    for scheme in ("int8", "int4-g128"):
        llm = LLM(model="llama-3.2-1b", load_format="dummy", device="cuda", quantization=scheme, max_model_len=256,
                  max_num_seqs=8)
        assert 0.5 < llm.engine.runner.linear_bytes_per_weight() <= 1.01
        assert llm.engine.runner.head_bytes_per_weight() == 2.0  # tied to the embedding: not quantized
        outs = llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        del llm
        torch.cuda.empty_cache()


def test_one_token_layers_fold_norms_and_residual_adds_into_the_w4_kernel(tmp_path, monkeypatch):
    """Batch-1 decode with int4 linears: the mma kernel takes each layer's RMSNorms (NORM) and residual
    adds (RESIDUAL), and generates what the same model with those ops apart (ROOFLM_W4_FOLD=0's path)
    generates: identical greedy tokens up to a near-tie, with CUDA graphs and eager."""
    from rooflm.kernels import w4a16
    src, _ = make_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    _write_quantized_copy(src, str(tmp_path / "q"), "awq", WeightScheme.parse("int4-g64"))
    folds = []
    real = w4a16.w4a16_folded
    monkeypatch.setattr(w4a16, "w4a16_folded", lambda *a, **k: (lambda y: (folds.append(y is not None), y)[1])(
        real(*a, **k)))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)

    def run(eager):
        llm = LLM(model=str(tmp_path / "q"), device="cuda", dtype="bfloat16", max_num_seqs=1, max_model_len=256,
                  enforce_eager=eager)
        outs = [llm.generate([p], params)[0] for p in PROMPTS[:4]]
        del llm
        torch.cuda.empty_cache()
        return outs

    for eager in (True, False):
        del folds[:]
        folded = run(eager)
        assert folds and all(folds), "every one-token layer should fold into the W4 kernel"
        with envs.override("ROOFLM_W4_FOLD", "0"):
            apart = run(eager)
        check_greedy_close(folded, apart)
