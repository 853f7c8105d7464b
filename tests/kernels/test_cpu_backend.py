"""CpuBackend (rooflm/layers/cpu_attention.py) against ReferenceBackend, through the attention layer."""

import pytest
import torch

from rooflm.layers.attention import Attention, ReferenceBackend
from rooflm.layers.cpu_attention import CpuBackend
from rooflm.layers.rotary import RotaryEmbedding
from tests.kernels.helpers import random_paged_batch


def run_layers(seq_lens, query_lens, consecutive=False, hole=None, window=None, layers=2,
               dtype=torch.float32):
    """Two attention layers of one step (the plan is made at the first and reused), on both
    backends: outputs and caches must agree."""
    heads, kv_heads, dim, block_size = 6, 2, 32, 8
    meta, k_cache, v_cache = random_paged_batch(seq_lens, query_lens, kv_heads, dim, block_size,
                                                dtype, "cpu")
    if consecutive:  # the usual case: the sequence's blocks were handed out in order
        n = meta.block_tables.shape[1]
        meta.block_tables[0] = torch.arange(2, 2 + n, dtype=torch.int32)
        from rooflm.engine.block_manager import slot_mapping
        q_len = query_lens[0]
        meta.slot_mapping = torch.tensor(slot_mapping(list(range(2, 2 + n)), seq_lens[0] - q_len,
                                                      q_len, block_size))
        k_cache[2:2 + n] = torch.randn_like(k_cache[2:2 + n])
        v_cache[2:2 + n] = torch.randn_like(v_cache[2:2 + n])
        tail = seq_lens[0] % block_size
        if tail:  # past the context: poison, which a read past the end would spread
            k_cache[1 + n, tail:] = float("nan")
            v_cache[1 + n, tail:] = float("nan")
    if hole is not None:
        meta.slot_mapping[hole] = -1
    t = meta.query_start_loc_cpu[-1]
    positions = torch.tensor([p for n, q in zip(seq_lens, query_lens) for p in range(n - q, n)])
    rotary = RotaryEmbedding(dim, 256, 10000.0, None)
    inputs = [[torch.randn(t, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads)]
              for _ in range(layers)]
    results = []
    for backend in (CpuBackend(), ReferenceBackend()):
        meta.plan = None
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(layers)]
        attn = Attention(heads, kv_heads, dim, rotary, window, backend)
        outs = [attn(positions, q, k, v, cache, meta) for (q, k, v), cache in zip(inputs, caches)]
        results.append((outs, caches))
        if isinstance(backend, CpuBackend):
            plan = meta.plan
    (outs, caches), (refs, ref_caches) = results
    for out, ref in zip(outs, refs):
        assert not out.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for (kc, vc), (kr, vr) in zip(caches, ref_caches):
        assert torch.equal(kc.nan_to_num(7.0), kr.nan_to_num(7.0))
        assert torch.equal(vc.nan_to_num(7.0), vr.nan_to_num(7.0))
    meta.plan = plan
    return meta


def test_single_decode_reads_consecutive_blocks_in_place():
    meta = run_layers([37], [1], consecutive=True)
    assert meta.plan.first_block == 2 and meta.plan.decode_len == 37


def test_single_decode_gathers_scattered_blocks():
    meta = run_layers([37], [1])
    assert meta.plan.decode_len == 37
    if meta.plan.first_block is None:
        return
    table = meta.block_tables[0, :meta.plan.num_blocks].tolist()
    assert table == list(range(table[0], table[0] + len(table)))  # random order happened to be in order


@pytest.mark.parametrize("seq_lens, query_lens", [([5, 70, 33], [1, 1, 1]), ([40, 120, 30], [1, 16, 30]),
                                                   ([23], [23])])
def test_other_steps_take_the_reference_path(seq_lens, query_lens):
    meta = run_layers(seq_lens, query_lens)
    assert meta.plan.decode_len is None


def test_padding_slots_are_not_written():
    meta = run_layers([40, 3, 120], [1, 1, 16], hole=2)
    assert not meta.plan.all_slots_valid


def test_sliding_window_longer_than_the_context_takes_the_reference():
    run_layers([37], [1], consecutive=True, window=16)


def test_bfloat16_activations():
    meta = run_layers([19], [1], consecutive=True, dtype=torch.bfloat16)
    assert meta.plan.cos.dtype == torch.bfloat16
