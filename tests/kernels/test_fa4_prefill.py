"""FlashAttention-4's Hopper prefill path (rooflm/kernels/fa4_prefill.py).

On the CPU: the choice (config, errors, default block size) and the plan (FA4's view of a step's
prefill sequences). On an H100 with the flash-attn-4 package: TritonBackend with FA4 prefill
against the reference, call for call, and the engine's greedy tokens with FA4 against the Triton
kernel's. The GPU tests need the package, which the CPU set-up does not install; on the GPU
machine it comes from benchmarks/fa4_setup.sh.
"""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close, random_paged_batch
from rooflm.config import EngineConfig, RuntimeConfig
from rooflm.layers.cuda_attention import TritonBackend
from rooflm.kernels.fa4_prefill import (FA4_BLOCK_SIZE, FA4Plan, MIN_QUERY_LEN, fa4_block_size, fa4_enabled,
                                        fa4_supports, plan_fa4_prefill)
from rooflm.layers.attention import ReferenceBackend


def test_prefill_attention_choice_is_checked():
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, triton, fa4; got 'flash'"):
        RuntimeConfig(prefill_attention="flash")
    with pytest.raises(ValueError, match="attention_backend must be auto, triton or reference"):
        RuntimeConfig(attention_backend="cudnn")


def test_fa4_off_the_gpu():
    cpu = torch.device("cpu")
    assert not fa4_enabled("auto", cpu) and not fa4_enabled("triton", cpu)
    with pytest.raises(ValueError, match="prefill_attention=fa4 needs a compute capability 9.x GPU"):
        fa4_enabled("fa4", cpu)
    assert fa4_block_size(EngineConfig(), cpu) is None


def test_plan_covers_the_prefill_sequences_after_the_decodes():
    # 2 decodes, a 96-token chunk over a 200-token context, a fresh 70-token prompt.
    meta, _, _ = random_paged_batch([40, 9, 200, 70], [1, 1, 96, 70], 2, 64, 16, torch.float16, DEVICE)
    plan = plan_fa4_prefill(meta)
    assert (plan.token_lo, plan.token_hi, plan.max_seqlen_q) == (2, 168, 96)
    assert plan.cu_seqlens_q.tolist() == [0, 96, 166] and plan.cu_seqlens_q.dtype == torch.int32
    assert plan.seqused_k.tolist() == [200, 70] and plan.seqused_k.dtype == torch.int32
    assert torch.equal(plan.page_table, meta.block_tables[2:].to(torch.int32))
    assert plan.page_table.is_contiguous()


def test_fa4_takes_only_what_it_supports():
    meta, k_cache, _ = random_paged_batch([300, 70], [128, 70], 2, 64, 16, torch.bfloat16, DEVICE)
    q = torch.zeros(198, 8, 64, dtype=torch.bfloat16)
    assert fa4_supports(q, k_cache, meta, None)
    assert not fa4_supports(q, k_cache, meta, 64)  # sliding window
    assert not fa4_supports(q.float(), k_cache, meta, None)  # fp32 queries
    assert not fa4_supports(q, k_cache.to(torch.float8_e4m3fn), meta, None)  # FP8 cache
    short, k_short, _ = random_paged_batch([300, 70], [MIN_QUERY_LEN - 1, 5], 2, 64, 16, torch.bfloat16, DEVICE)
    assert not fa4_supports(q, k_short, short, None)  # spec verify spans and other short chunks


def test_deterministic_backend_never_plans_fa4():
    assert not TritonBackend(deterministic=True, prefill_fa4=True).prefill_fa4


# ---- GPU: the real kernel ----------------------------------------------------------------------

requires_fa4 = pytest.mark.skipif(not (torch.cuda.is_available() and fa4_enabled("auto", torch.device("cuda"))),
                                  reason="needs an sm_90 GPU and the flash-attn-4 package")


def run_step(seq_lens, query_lens, block_size, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16):
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, kv_heads, head_dim, block_size, dtype, DEVICE)
    # FA4 loads a sequence's last block whole (one TMA tile) and masks the keys past its end, so
    # those slots must hold finite values, as the engine's do (zeros, or an earlier sequence's
    # K/V). Poisoned with large finite values instead of NaN: a kernel that let them into the
    # softmax or the sum would still fail.
    k_cache.nan_to_num_(3e4)
    v_cache.nan_to_num_(3e4)
    t = meta.query_start_loc_cpu[-1]
    q, k, v = (torch.randn(t, h, head_dim, device=DEVICE).to(dtype) for h in (heads, kv_heads, kv_heads))
    outs = []
    for backend in (TritonBackend(prefill_fa4=True), ReferenceBackend()):
        caches = (k_cache.clone(), v_cache.clone())
        backend.write_kv(k, v, *caches, meta.slot_mapping)
        outs.append(backend.attend(q, *caches, meta, head_dim ** -0.5, None))
        if isinstance(backend, TritonBackend):
            assert isinstance(meta.plan[None][1], FA4Plan)
            meta.plan = None
    assert_close(outs[0], outs[1], dtype, "attention output")


@pytest.mark.gpu
@requires_fa4
@pytest.mark.parametrize("block_size", [64, FA4_BLOCK_SIZE])
def test_fa4_mixed_step_matches_reference(block_size):
    # decodes first, then a chunk over a cached prefix, a fresh prompt, a chunk shorter than a tile.
    run_step([3000, 17, 5000, 700, 333], [1, 1, 1024, 700, 77], block_size)


@pytest.mark.gpu
@requires_fa4
def test_fa4_head_dim_64_fp16_all_prefill():
    run_step([129, 64, 1000], [129, 64, 1000], FA4_BLOCK_SIZE, heads=8, kv_heads=2, head_dim=64, dtype=torch.float16)


@pytest.mark.gpu
@requires_fa4
def test_engine_with_fa4_prefill_matches_triton_prefill(tmp_path):
    """Greedy tokens of a tiny bf16 model, chunked prefill over prefix hits included, the same
    with FA4 prefill as with the Triton kernel; the engine defaults to FA4 and 128-token blocks."""
    from rooflm import LLM, SamplingParams
    from tests.models.tiny_models import make_tiny_model

    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3, hidden_size=512)  # head_dim 128
    base = [(7 * i) % 250 + 3 for i in range(300)]
    prompts = [base + [7, 8, 9], base[:200] + [11, 12], list(range(100, 180))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(model=path, device="cuda", dtype="bfloat16", max_num_batched_tokens=256, block_size=FA4_BLOCK_SIZE)
    ref = LLM(prefill_attention="triton", **kw).generate(prompts, params)
    llm = LLM(**{k: v for k, v in kw.items() if k != "block_size"})
    assert llm.engine.config.cache.block_size == FA4_BLOCK_SIZE
    assert llm.engine.runner.backend.prefill_fa4
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
