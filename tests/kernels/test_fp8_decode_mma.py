"""The CUDA FP8 decode kernel (kernels/fp8_decode_mma.py, csrc/fp8_decode_attention.cu) against the
fp32 reference and the Triton kernel it replaces, its dispatch, CUDA-graph capture and determinism."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
from tests.kernels.test_fp8_kv import fp8_batch, fp8_static_batch
from rooflm.kernels import fp8_decode_mma
from rooflm.kernels.decode_attention import decode_attention, decode_attention_ref, plan_decode_attention
from rooflm.kernels.fp8_decode_mma import Fp8DecodeConfig


def _static_call(seq_lens, num_kv_heads, group, block_size, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    meta, k8, v8, ks, vs = fp8_static_batch(seq_lens, [1] * len(seq_lens), num_kv_heads, 128, block_size)
    q = (torch.randn(len(seq_lens), num_kv_heads * group, 128, device=DEVICE) * 2).to(dtype)
    return meta, q, k8, v8, ks, vs


def test_cpu_tensors_and_unsupported_calls_stay_on_triton():
    meta, q, k8, v8, ks, vs = _static_call([5], 2, 4, 16)
    if not q.is_cuda:
        assert not fp8_decode_mma.supported(q, k8, v8, ks, False)
        return
    assert fp8_decode_mma.supported(q, k8, v8, ks, False)
    assert not fp8_decode_mma.supported(q, k8, v8, ks, True)                 # sliding window
    assert not fp8_decode_mma.supported(q, k8, v8, ks[None, None].expand(4, 16, 2), False)  # per token
    assert not fp8_decode_mma.supported(q.float(), k8, v8, ks, False)        # fp32 q
    big = torch.zeros(5, 2 * 16, 128, device=DEVICE, dtype=q.dtype)          # a group of 16
    assert not fp8_decode_mma.supported(big, k8, v8, ks, False)


def test_shared_memory_holds_the_stages_and_the_combine_record():
    assert fp8_decode_mma.shared_bytes(Fp8DecodeConfig(4, 1, 4, 0), 4) == 0
    assert fp8_decode_mma.shared_bytes(Fp8DecodeConfig(4, 1, 4, 3), 4) == 4 * 3 * 4096
    # a group of 8's combine record (8 x 128 fp32, m and l: 4,160 bytes) fits in two stages
    assert fp8_decode_mma.shared_bytes(Fp8DecodeConfig(2, 1, 1, 2), 8) == 2 * 2 * 4096


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens,num_kv_heads,group,block_size,num_splits", [
    ([1, 15, 16, 17, 33, 130], 2, 4, 16, 1),       # partial chunks, one key
    ([330] * 24 + [1, 2, 1500], 8, 4, 64, 1),       # the engine's block size, Llama-3-8B's heads
    ([300, 7, 129], 1, 8, 128, 4),                   # a full GQA group of 8, splits (one empty)
    ([45, 12, 257], 2, 1, 32, None),                 # MHA (group 1), the split heuristic
    ([4097], 8, 4, 64, 64),                          # one long sequence in many splits
    ([600, 64], 4, 2, 16, 3),
])
def test_static_fp8_decode_on_mma_matches_reference_and_triton(seq_lens, num_kv_heads, group, block_size, num_splits,
                                                               dtype):
    meta, q, k8, v8, ks, vs = _static_call(seq_lens, num_kv_heads, group, block_size, dtype)
    scale = 128 ** -0.5
    plan = plan_decode_attention(q, k8, v8, meta, num_splits=num_splits, k_scale=ks, v_scale=vs, mma=True)
    assert plan.mma
    # by default split calls keep the Triton kernel (short ranges: faster there)
    assert plan_decode_attention(q, k8, v8, meta, num_splits=num_splits, k_scale=ks, v_scale=vs).mma == \
        (plan.num_splits == 1)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k8, v8, meta, scale, out=out, plan=plan, k_scale=ks, v_scale=vs)
    ref = decode_attention_ref(q, k8, v8, meta, scale, k_scale=ks, v_scale=vs)
    assert_close(out, ref, torch.float16, "fp8 decode mma")
    tri = torch.full_like(q, float("nan"))
    decode_attention(q, k8, v8, meta, scale, out=tri, num_splits=num_splits, k_scale=ks, v_scale=vs, _mma=False)
    assert_close(out, tri, torch.float16, "fp8 decode mma vs triton")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [Fp8DecodeConfig(2, 1, 1), Fp8DecodeConfig(8, 3, 1), Fp8DecodeConfig(4, 2, 3),
                                    Fp8DecodeConfig(4, 1, 4, 3), Fp8DecodeConfig(8, 1, 2, 2), Fp8DecodeConfig(2, 1, 1, 4)])
def test_every_config_gives_the_reference(config):
    meta, q, k8, v8, ks, vs = _static_call([1, 31, 500, 1029], 8, 4, 64)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k8, v8, meta, 128 ** -0.5, out=out, k_scale=ks, v_scale=vs, _mma_config=config, _mma=True)
    assert_close(out, decode_attention_ref(q, k8, v8, meta, 128 ** -0.5, k_scale=ks, v_scale=vs),
                 torch.float16, f"fp8 decode mma {config}")


@pytest.mark.gpu
def test_bits_repeat_and_a_graph_replays_new_lengths():
    meta, q, k8, v8, ks, vs = _static_call([200, 900, 64], 8, 4, 64)
    scale = 128 ** -0.5
    a = decode_attention(q, k8, v8, meta, scale, num_splits=4, k_scale=ks, v_scale=vs, _mma=True)
    b = decode_attention(q, k8, v8, meta, scale, num_splits=4, k_scale=ks, v_scale=vs, _mma=True)
    assert torch.equal(a, b)  # fixed chunk order, fixed warp and split combine: no atomics
    out = torch.zeros_like(q)
    plan = plan_decode_attention(q, k8, v8, meta, num_splits=4, k_scale=ks, v_scale=vs, mma=True)
    assert plan.mma
    decode_attention(q, k8, v8, meta, scale, out=out, plan=plan, k_scale=ks, v_scale=vs)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k8, v8, meta, scale, out=out, plan=plan, k_scale=ks, v_scale=vs)
    meta.seq_lens.copy_(torch.tensor([150, 899, 1], dtype=torch.int32))  # shorter: same blocks, same graph
    meta.seq_lens_cpu = [150, 899, 1]
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, decode_attention_ref(q, k8, v8, meta, scale, k_scale=ks, v_scale=vs), torch.float16,
                 "fp8 decode mma graph replay")


@pytest.mark.gpu
def test_per_token_scales_keep_the_triton_kernel():
    torch.manual_seed(0)
    meta, k8, v8, ks, vs = fp8_batch([40, 300], [1, 1], 2, 128, 16)
    q = torch.randn(2, 8, 128, device=DEVICE).to(torch.bfloat16)
    assert not plan_decode_attention(q, k8, v8, meta, k_scale=ks, v_scale=vs).mma
