"""End to end on the GPU: the Triton path against the torch reference path, graphs on and off,
and HF transformers on the same device. Run with `pytest -m gpu`."""

import pytest
import torch

from rooflm import LLM, SamplingParams
from tests.models.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu


def check_greedy_close(a, b, top_n=5):
    """Identical greedy tokens, or at the first divergence each side's token is among the other's
    top-N logprobs (both paths are right, a near-tie fell the other way); nothing after it compares."""
    for x, y in zip(a, b):
        ta, tb = x.outputs[0].token_ids, y.outputs[0].token_ids
        for i, (p, q) in enumerate(zip(ta, tb)):
            if p != q:
                assert p in y.outputs[0].logprobs[i] and q in x.outputs[0].logprobs[i], \
                    f"diverged at {i}: {p} vs {q}, not within each other's top {top_n}"
                break
        else:
            assert ta == tb


def generate(model, prompts, backend, eager, dtype="bfloat16", tokens=64, **kw):
    llm = LLM(model=model, device="cuda", dtype=dtype, attention_backend=backend, enforce_eager=eager, **kw)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params)
    del llm
    torch.cuda.empty_cache()
    return outs


PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 40, 17, 97, 1, 64, 33, 8])]


# Every family on the one decoder: OLMo 2 (post-norms, q/k norm over the projection) and Gemma 2
# ((1 + w) norms, GELU-tanh, soft-capped scores and logits, alternating windows) take the fused
# paths part by part.
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "olmo2", "gemma2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_triton_matches_reference_and_hf(tmp_path, family):
    path, hf = make_tiny_model(tmp_path, family, initializer_range=0.3)
    ref = generate(path, PROMPTS, "reference", True, dtype="float32")
    fast = generate(path, PROMPTS, "triton", True, dtype="float32")
    check_greedy_close(fast, ref)
    # HF on the same GPU agrees on the first tokens.
    hf = hf.cuda().float()
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, fast):
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1]
            assert int(logits.argmax()) == out.outputs[0].token_ids[0]


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma2"])
def test_graphs_match_eager(tmp_path, family):
    path, _ = make_tiny_model(tmp_path, family, initializer_range=0.3)
    for batch in (1, 2, 4, 8):
        eager = generate(path, PROMPTS[:batch], "triton", True)
        graphs = generate(path, PROMPTS[:batch], "triton", False, piecewise_cuda_graphs=False)
        assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


def test_decode_graphs_share_one_logits_buffer(tmp_path):
    """Every captured batch size widens its logits into one [max_batch, vocab] buffer: a buffer
    per graph held the sum of all sizes' rows (~8.8 GB at 1024 sequences of an 8B model), which
    ran an 8B engine at --max-num-seqs 1024 out of memory."""
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3, vocab_size=32000)
    llm = LLM(model=path, device="cuda", dtype="bfloat16", max_num_seqs=512, piecewise_cuda_graphs=False,
              num_blocks=64)
    runner = llm.engine.runner.graphs
    vocab = 32000
    assert runner.logits.shape == (512, vocab) and runner.logits.dtype == torch.float32
    # The pool holds the largest graph's activations, not one logits tensor per size (~0.6 GB
    # here before: 4,743 rows of 32,000 fp32 over the 27 sizes).
    pool_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                     if s.get("segment_pool_id") == tuple(runner.pool))
    assert pool_bytes < 512 * vocab * 4
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eager = generate(path, PROMPTS, "triton", True, tokens=8)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    del llm
    torch.cuda.empty_cache()


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "gemma2"])
def test_piecewise_graphs_match_eager(tmp_path, family):
    """Chunked prompts beside decodes (mixed steps) replayed as per-layer graphs with attention
    eager between them. Padding to a bucket changes GEMM shapes, so bf16 rounding may differ."""
    path, _ = make_tiny_model(tmp_path, family, initializer_range=0.3)
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8)
    eager = generate(path, PROMPTS, "triton", True, **kw)
    pieces = generate(path, PROMPTS, "triton", False, **kw)
    check_greedy_close(pieces, eager)
    fp32_eager = generate(path, PROMPTS, "triton", True, dtype="float32", **kw)
    fp32_pieces = generate(path, PROMPTS, "triton", False, dtype="float32", **kw)
    check_greedy_close(fp32_pieces, fp32_eager)


@pytest.mark.parametrize("num_prompts", [2, 1])  # 1: batch-1 decode runs the fused GEMV layers
def test_llama3_8b_shape_triton_matches_reference(num_prompts):
    prompts = [list(range(100, 228)), list(range(500, 517))][:num_prompts]
    kw = dict(load_format="dummy", max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.8)
    ref = generate("llama-3-8b", prompts, "reference", True, **kw)
    fast = generate("llama-3-8b", prompts, "triton", False, **kw)
    check_greedy_close(fast, ref)


def test_async_scheduling_matches_sync(tmp_path):
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    sync = generate(path, PROMPTS, "triton", False, async_scheduling=False)
    async_ = generate(path, PROMPTS, "triton", False, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in async_] == [o.outputs[0].token_ids for o in sync]


def test_temperature_rows_take_the_fused_sampler(tmp_path, monkeypatch):
    """A batch of greedy and plain-temperature requests samples through kernels/gumbel_sample.py
    (CUDA graphs, async scheduling): the greedy rows keep the all-greedy run's tokens, and
    torch.manual_seed makes the sampled rows repeat."""
    import rooflm.kernels.gumbel_sample as gumbel
    calls = []
    real = gumbel.gumbel_sample
    monkeypatch.setattr(gumbel, "gumbel_sample", lambda *a: calls.append(1) or real(*a))
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3)
    llm = LLM(model=path, device="cuda", dtype="bfloat16")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    hot = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    assert not calls  # all-greedy batches take the plain argmax
    params = [greedy if i % 2 == 0 else hot for i in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
    del llm
    torch.cuda.empty_cache()
    assert calls and runs[0] == runs[1]
    assert all(len(t) == 24 for t in runs[0])
    assert [runs[0][i] for i in range(0, len(PROMPTS), 2)] == [ref[i] for i in range(0, len(PROMPTS), 2)]
    assert [runs[0][i] for i in range(1, len(PROMPTS), 2)] != [ref[i] for i in range(1, len(PROMPTS), 2)]
