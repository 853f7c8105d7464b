"""Per-layer rotaries (layers/rotary.py: several bases in one model, partial rotary, none) through
the attention backends: the Triton backend's rope+write (fused kernel where the table is as wide
as the head, the torch rotation + plain KV write otherwise) and the CPU backend's once-a-step
plan each equal the reference backend, layer by layer within one step."""

import pytest
import torch

from rooflm.config import RopeScaling
from rooflm.layers.attention import Attention, ReferenceBackend
from rooflm.layers.cpu_attention import CpuBackend
from rooflm.layers.rotary import NoRotary, RotaryEmbedding
from tests.kernels.helpers import DEVICE, random_paged_batch

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 8
LONGROPE = RopeScaling("longrope", factor=4.0, original_max_position_embeddings=16,
                       short_factor=tuple(1.0 + 0.1 * i for i in range(12)),
                       long_factor=tuple(1.0 + 0.5 * i for i in range(12)))


def rotaries():
    """What one model's layers may hold: two bases (Gemma 3), a linear scaling, a partial
    LongRoPE (Phi-4-mini's 3/4 of the head), and none (SmolLM3)."""
    return [RotaryEmbedding(DIM, 128, 100.0, None),
            RotaryEmbedding(DIM, 128, 10000.0, RopeScaling("linear", 4.0)),
            RotaryEmbedding(DIM, 128, 10000.0, LONGROPE, rotary_dim=24),
            NoRotary(),
            RotaryEmbedding(DIM, 128, 100.0, None)]


def run_step(backend, seq_lens, query_lens, device):
    torch.manual_seed(0)
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, KV_HEADS, DIM, BLOCK, torch.float32, device)
    t = meta.query_start_loc_cpu[-1]
    positions = torch.tensor([p for n, q in zip(seq_lens, query_lens) for p in range(n - q, n)], device=device)
    outs, caches = [], []
    for rotary in rotaries():
        q, k, v = (torch.randn(t, h, DIM, device=device) for h in (HEADS, KV_HEADS, KV_HEADS))
        cache = (k_cache.clone(), v_cache.clone())
        attn = Attention(HEADS, KV_HEADS, DIM, rotary.to(device), None, backend)
        outs.append(attn(positions, q, k, v, cache, meta))
        caches.append(cache)
    return outs, caches


def assert_same(a, b, tol):
    (outs, caches), (refs, ref_caches) = a, b
    for out, ref in zip(outs, refs):
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for (kc, vc), (kr, vr) in zip(caches, ref_caches):
        torch.testing.assert_close(kc.nan_to_num(7.0), kr.nan_to_num(7.0), rtol=tol, atol=tol)
        torch.testing.assert_close(vc.nan_to_num(7.0), vr.nan_to_num(7.0), rtol=tol, atol=tol)


@pytest.mark.parametrize("seq_lens,query_lens", [([21], [1]), ([21], [21]), ([9, 30], [3, 1])])
def test_cpu_plan_serves_each_layers_rotary(seq_lens, query_lens):
    assert_same(run_step(CpuBackend(), seq_lens, query_lens, "cpu"),
                run_step(ReferenceBackend(), seq_lens, query_lens, "cpu"), 1e-5)


@pytest.mark.parametrize("seq_lens,query_lens", [([21], [1]), ([9, 30], [9, 2])])
def test_triton_rope_and_write_serves_each_layers_rotary(seq_lens, query_lens):
    """Positions cross LongRoPE's original context (16): both factor sets are read."""
    from rooflm.layers.cuda_attention import TritonBackend

    triton, ref = TritonBackend(), ReferenceBackend()
    torch.manual_seed(1)
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, KV_HEADS, DIM, BLOCK, torch.float32, DEVICE)
    t = meta.query_start_loc_cpu[-1]
    positions = torch.tensor([p for n, q in zip(seq_lens, query_lens) for p in range(n - q, n)], device=DEVICE)
    for rotary in rotaries():
        rotary = rotary.to(DEVICE)
        q, k, v = (torch.randn(t, h, DIM, device=DEVICE) for h in (HEADS, KV_HEADS, KV_HEADS))
        results = []
        for backend in (triton, ref):
            kc, vc = k_cache.clone(), v_cache.clone()
            q_out = backend.rope_and_write(q.clone(), k.clone(), v, positions, rotary, kc, vc, meta.slot_mapping)
            results.append((q_out, kc, vc))
        for a, b in zip(*results):
            torch.testing.assert_close(a.nan_to_num(7.0), b.nan_to_num(7.0), rtol=1e-5, atol=1e-5)
    # The partial rotary's narrower table goes through the fused kernel (rotating its first R
    # elements); the absent one has no table and takes the plain KV write.
    partial, none = rotaries()[2], rotaries()[3]
    assert partial.cos_sin_cache.shape[-1] < DIM and not hasattr(none, "cos_sin_cache")


def test_partial_rotary_leaves_the_tail_and_none_leaves_everything():
    positions = torch.arange(5) + 3
    q, k = torch.randn(5, HEADS, DIM), torch.randn(5, KV_HEADS, DIM)
    full = RotaryEmbedding(24, 128, 10000.0, LONGROPE)
    partial = RotaryEmbedding(DIM, 128, 10000.0, LONGROPE, rotary_dim=24)
    qp, kp = partial(positions, q, k)
    qf, kf = full(positions, q[..., :24].contiguous(), k[..., :24].contiguous())
    assert torch.equal(qp[..., 24:], q[..., 24:]) and torch.equal(kp[..., 24:], k[..., 24:])
    torch.testing.assert_close(qp[..., :24], qf)
    torch.testing.assert_close(kp[..., :24], kf)
    assert all(torch.equal(a, b) for a, b in zip(NoRotary()(positions, q, k), (q, k)))
