"""The LoRA shrink/expand kernels (rooflm/kernels/lora_shrink.py, lora_expand.py) against their
torch references, on mixed batches: tokens of several slots, interleaved, and tokens of none."""

import numpy as np
import pytest
import torch

from rooflm.kernels.lora_expand import lora_expand, lora_expand_ref
from rooflm.kernels.lora_shrink import lora_shrink, lora_shrink_ref, shrink_total
from rooflm.lora.mapping import LoRAMapping
from tests.kernels.helpers import DEVICE, assert_close


def _mapping(slots: list[int], decode_only: bool) -> LoRAMapping:
    m = LoRAMapping(torch.device(DEVICE))
    m.set_step(slots, decode_only)
    return m


def _run(x, lora_a, lora_b, y, shards, rank, m: LoRAMapping, num_splits=None):
    h = lora_shrink(x, lora_a, m.token_slots, m.token_order, m.seg_starts, m.seg_slots, m.max_seg_len,
                    m.decode_only, num_splits=num_splits)
    out = y.clone()
    lora_expand(h, lora_b, out, shards, rank, m.token_slots, m.token_order, m.seg_starts, m.seg_slots,
                m.max_seg_len, m.decode_only)
    return h, out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("decode_only,num_splits", [(False, None), (False, 2), (True, None), (True, 3)])
@pytest.mark.parametrize("rank", [4, 16])
def test_shrink_expand_match_reference_on_a_mixed_batch(dtype, decode_only, num_splits, rank):
    """Steps split K (num_splits partial sums, added by the expand) and the expand covers
    every shard in one launch: the shard boundaries fall inside one 64-column block here."""
    gen = torch.Generator().manual_seed(rank + 7 * decode_only)
    num_slots, k = 3, 40  # K not a multiple of the block: masked tails
    shards = [(0, 24), (24, 8), (32, 8)]  # q, k, v of a tiny GQA layer
    out_features = 40
    # Tokens of slots 2, 0, none, 2, 1, ... interleaved: grouping by slot must gather them.
    slots = [2, 0, -1, 2, 1, 1, -1, 0, 2, 2, 0, 1, -1, 2, 0, 0, 0, 0, 1, 2, 2]
    if decode_only:
        slots = slots[:9]
    t = len(slots)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    lora_a = (torch.randn(num_slots, len(shards) * rank, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    lora_b = torch.randn(num_slots, out_features, rank, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(t, out_features, generator=gen).to(dtype).to(DEVICE)
    m = _mapping(slots, decode_only)
    h, out = _run(x, lora_a, lora_b, y, shards, rank, m, num_splits)
    assert h.shape[0] == (num_splits or 1)
    token_slots = torch.tensor(slots, device=DEVICE)
    h_ref = lora_shrink_ref(x, lora_a, token_slots)
    assert_close(shrink_total(h, token_slots), h_ref, dtype, "shrink")
    ref = lora_expand_ref(h_ref, lora_b, y, shards, rank, token_slots)
    assert_close(out, ref, dtype, "expand")
    none = token_slots < 0
    assert torch.equal(out[none], y[none]), "tokens without an adapter must keep the base output bit for bit"
    assert not torch.equal(out[~none], y[~none])


def test_a_step_without_adapters_launches_nothing_and_changes_nothing():
    m = _mapping([-1, -1, -1], decode_only=False)
    assert not m.active
    x = torch.randn(3, 16, device=DEVICE)
    y = torch.randn(3, 16, device=DEVICE)
    a = torch.randn(2, 8, 16, device=DEVICE)
    b = torch.randn(2, 16, 8, device=DEVICE)
    h, out = _run(x, a, b, y, [(0, 16)], 8, m)
    assert torch.equal(out, y)


def test_expand_refuses_h_of_the_wrong_width():
    m = _mapping([0, 0], decode_only=False)
    with pytest.raises(ValueError, match="shards of rank"):
        lora_expand(torch.zeros(2, 8, device=DEVICE), torch.zeros(1, 16, 8, device=DEVICE),
                    torch.zeros(2, 16, device=DEVICE), [(0, 8), (8, 8)], 8, m.token_slots, m.token_order,
                    m.seg_starts, m.seg_slots, m.max_seg_len, False)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,decode_only", [(64, True), (1, True), (3000, False)])
def test_kernels_gpu_llama8b_shapes_bf16(num_tokens, decode_only):
    """Llama-3-8B's qkv (4096 -> 4096 + 2 x 1024), rank 16, 16 slots, tokens spread over them."""
    dtype, rank, k = torch.bfloat16, 16, 4096
    shards = [(0, 4096), (4096, 1024), (5120, 1024)]
    slots = torch.randint(-1, 16, (num_tokens,)).tolist()
    slots[0] = 3  # at least one token under an adapter
    x = torch.randn(num_tokens, k, device="cuda", dtype=dtype)
    lora_a = torch.randn(16, 3 * rank, k, device="cuda", dtype=dtype) / k ** 0.5
    lora_b = torch.randn(16, 6144, rank, device="cuda", dtype=dtype)
    y = torch.randn(num_tokens, 6144, device="cuda", dtype=dtype)
    m = _mapping(slots, decode_only)
    h, out = _run(x, lora_a, lora_b, y, shards, rank, m)
    token_slots = torch.tensor(slots, device="cuda")
    assert_close(shrink_total(h, token_slots), lora_shrink_ref(x, lora_a, token_slots), dtype, "shrink")
    assert_close(out, lora_expand_ref(lora_shrink_ref(x, lora_a, token_slots), lora_b, y, shards, rank,
                                      token_slots), dtype, "expand")


@pytest.mark.parametrize("decode_only", [False, True])
def test_the_hook_gives_the_same_through_triton_and_torch(decode_only):
    """LoRALinearHook's two paths on a fused q/k/v linear with adapters of ranks 3 and 8 in a
    pool of rank 8 (zero-padded), scaling folded into B."""
    from rooflm.layers.linear import FusedLinear
    from rooflm.lora.hook import LoRALinearHook

    torch.manual_seed(3)
    linear = FusedLinear(32, {"q": 32, "k": 16, "v": 16}).to(DEVICE)
    torch.nn.init.normal_(linear.weight)
    slots = [1, -1, 0, 1] if decode_only else [1, 1, 1, -1, 0, 0, 1, -1, 0]
    m = _mapping(slots, decode_only)
    hooks = [LoRALinearHook(linear, num_slots=2, rank=8, mapping=m, use_triton=t) for t in (False, True)]
    for slot, (rank, shards) in enumerate(((3, ("q", "v")), (8, ("q", "k", "v")))):
        for shard in shards:
            size = linear.shard_offsets[shard][1]
            a, b = torch.randn(rank, 32), torch.randn(size, rank)
            for hook in hooks:
                hook.write(slot, shard, a, b, scaling=0.5)
    x = torch.randn(len(slots), 32, device=DEVICE)
    outs = []
    for hook in hooks:
        linear.lora = hook
        outs.append(linear(x))
    assert_close(outs[1], outs[0], torch.float32, "triton vs torch hook")
    linear.lora = None
    base = linear(x)
    none = torch.tensor(slots) < 0
    assert torch.equal(outs[0][none], base[none])
    assert not torch.allclose(outs[0][~none], base[~none])


def test_graph_segments_group_rows_by_slot_stably_with_no_adapter_last():
    from rooflm.kernels.lora_shrink import graph_segments

    slots = torch.tensor([2, -1, 0, 2, -1, 1, 0, 2], dtype=torch.int32, device=DEVICE)
    order, starts, seg_slots = graph_segments(slots, num_slots=4)
    assert order.tolist() == [2, 6, 5, 0, 3, 7, 1, 4]
    assert starts.tolist() == [0, 2, 3, 6, 6], "slot 3 is empty; rows of no adapter begin at 6"
    assert seg_slots.tolist() == [0, 1, 2, 3]
    assert order.dtype == starts.dtype == seg_slots.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_graph_form_and_eager_decode_give_the_same_bits(dtype):
    """A captured decode step groups rows on the device, one group per slot of the pool, grid
    fixed by the batch; an eager step groups them on the host, non-empty slots only. The tiles
    and splits depend on the shapes and slot count alone, so each token's sums are the same:
    equal bits, not close. Slot 1 has 18 rows here: two M blocks of one group."""
    gen = torch.Generator().manual_seed(11)
    rank, k, num_slots = 8, 72, 4
    shards = [(0, 16), (16, 8), (24, 8)]
    slots = [1] * 18 + [-1, 3, 0, -1, 3, 1]
    t = len(slots)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    lora_a = (torch.randn(num_slots, len(shards) * rank, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    lora_b = torch.randn(num_slots, 32, rank, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(t, 32, generator=gen).to(dtype).to(DEVICE)
    eager = _mapping(slots, decode_only=True)
    graph = LoRAMapping(torch.device(DEVICE))
    graph.use_graph_slots(torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    outs = []
    for m in (eager, graph):
        order, starts, seg_slots, max_len, tiles = m.segments(num_slots)
        h = lora_shrink(x, lora_a, m.token_slots, order, starts, seg_slots, max_len, True, tiles=tiles)
        out = y.clone()
        lora_expand(h, lora_b, out, shards, rank, m.token_slots, order, starts, seg_slots, max_len, True,
                    tiles=tiles)
        outs.append(out)
    assert len(graph.segments(num_slots).seg_slots) == num_slots and len(eager.segments(num_slots).seg_slots) == 3
    assert torch.equal(outs[0], outs[1])
    token_slots = torch.tensor(slots, device=DEVICE)
    ref = lora_expand_ref(lora_shrink_ref(x, lora_a, token_slots), lora_b, y, shards, rank, token_slots)
    assert_close(outs[1], ref, dtype, "graph form")


def test_prefill_segments_longer_than_a_tile_match_the_reference():
    """A prefill segment of 70 tokens: 64-row tiles (two M blocks, the second mostly masked)."""
    gen = torch.Generator().manual_seed(5)
    rank, k, shards = 4, 24, [(0, 16), (16, 16)]  # gate, up
    slots = [0] * 70 + [-1, 1, 1]
    t = len(slots)
    x = torch.randn(t, k, generator=gen).to(DEVICE)
    lora_a = torch.randn(2, 2 * rank, k, generator=gen).to(DEVICE)
    lora_b = torch.randn(2, 32, rank, generator=gen).to(DEVICE)
    y = torch.randn(t, 32, generator=gen).to(DEVICE)
    m = _mapping(slots, decode_only=False)
    h, out = _run(x, lora_a, lora_b, y, shards, rank, m)
    token_slots = torch.tensor(slots, device=DEVICE)
    h_ref = lora_shrink_ref(x, lora_a, token_slots)
    assert_close(shrink_total(h, token_slots), h_ref, torch.float32, "shrink")
    assert_close(out, lora_expand_ref(h_ref, lora_b, y, shards, rank, token_slots), torch.float32, "expand")


# --------------------------------------------------------------------------
# The one-token GEMV chain with an adapter: the shrink's NORM, the GEMV's LORA epilogue
# --------------------------------------------------------------------------

def _one_token_case(gated: bool, graph_form: bool, slot: int = 1):
    from rooflm.layers.linear import FusedLinear
    from rooflm.lora.hook import LoRALinearHook

    gen = torch.Generator().manual_seed(21 + gated)
    k, rank, dtype = 48, 8, torch.float16
    sizes = {"gate": 24, "up": 24} if gated else {"q": 16, "k": 8, "v": 8}
    linear = FusedLinear(k, sizes)
    linear.weight.data = (torch.randn(linear.out_features, k, generator=gen) / k ** 0.5).to(dtype)
    linear = linear.to(DEVICE)
    m = LoRAMapping(torch.device(DEVICE))
    if graph_form:
        m.use_graph_slots(torch.tensor([slot], dtype=torch.int32, device=DEVICE))
    else:
        m.set_step([slot], decode_only=True)
    hook = LoRALinearHook(linear, num_slots=3, rank=rank, mapping=m, use_triton=True)
    hook.lora_a.copy_(torch.randn(hook.lora_a.shape, generator=gen) / k ** 0.5)
    hook.lora_b.copy_(torch.randn(hook.lora_b.shape, generator=gen))
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    return linear, hook, x, norm_w


def _one_token_ref(linear, hook, x, norm_w, slot, gated):
    """rmsnorm -> linear (+ the adapter's delta) -> act(gate) * up, each in the unfused ops' casts."""
    from rooflm.kernels.rmsnorm import rmsnorm_ref
    xn = rmsnorm_ref(x, norm_w, 1e-5)
    h = xn.float() @ hook.lora_a[slot].float().T
    delta = torch.cat([h[:, i * hook.rank:(i + 1) * hook.rank] @ hook.lora_b[slot, off:off + size].float().T
                       for i, (off, size) in enumerate(hook.shards)], dim=1)
    y = xn.float() @ linear.weight.float().T + delta
    if not gated:
        return y.to(x.dtype)
    gate, up = y.to(x.dtype).float().chunk(2, dim=1)
    return (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)


@pytest.mark.parametrize("gated,graph_form", [(False, False), (True, True)])
def test_gemv_with_the_adapter_epilogue_matches_norm_linear_and_delta(gated, graph_form):
    """qkv (three shards) and gate_up (the delta before SiLU-mul), pre-norm folded into both the
    base GEMV and the shrink; the slot read on the device, in the step's or the graph's form."""
    from rooflm.kernels.gemv import gemv

    linear, hook, x, norm_w = _one_token_case(gated, graph_form)
    epilogue = hook.gemv_epilogue(x, norm_w, 1e-5)
    out = gemv(x, linear.weight, norm_weight=norm_w, eps=1e-5, gated=gated, lora=epilogue)
    assert_close(out, _one_token_ref(linear, hook, x, norm_w, 1, gated), torch.float16, "gemv + lora")
    plain = gemv(x, linear.weight, norm_weight=norm_w, eps=1e-5, gated=gated)
    assert not torch.allclose(out.float(), plain.float(), atol=1e-2), "the delta was added"


def test_gemv_epilogue_of_slot_minus_one_adds_nothing_and_residual_comes_after():
    """A row of no adapter (a graph input of -1) gives the plain GEMV bit for bit; o_proj's form:
    the delta joins W a before the residual add."""
    from rooflm.kernels.gemv import gemv

    linear, hook, x, _ = _one_token_case(False, graph_form=True, slot=-1)
    res = torch.randn(1, linear.out_features, device=DEVICE).to(x.dtype)
    epilogue = hook.gemv_epilogue(x)
    assert torch.equal(gemv(x, linear.weight, residual=res, lora=epilogue), gemv(x, linear.weight, residual=res))
    hook.mapping.token_slots.fill_(2)  # the graph's input rewritten in place; a replay regroups,
    hook.mapping.use_graph_slots(hook.mapping.token_slots)  # as a new forward of the graph form does
    out = gemv(x, linear.weight, residual=res, lora=hook.gemv_epilogue(x))
    h = x.float() @ hook.lora_a[2].float().T
    delta = torch.cat([h[:, i * hook.rank:(i + 1) * hook.rank] @ hook.lora_b[2, off:off + size].float().T
                       for i, (off, size) in enumerate(hook.shards)], dim=1)
    ref = ((x.float() @ linear.weight.float().T + delta).to(x.dtype).float() + res.float()).to(x.dtype)
    assert_close(out, ref, torch.float16, "o_proj form")


# --------------------------------------------------------------------------
# GPU: a captured graph's step against eager steps, Llama-3-8B shapes
# --------------------------------------------------------------------------

def _gpu_hook(sizes: dict, k: int, num_slots: int = 16, rank: int = 16):
    from rooflm.layers.linear import FusedLinear
    from rooflm.lora.hook import LoRALinearHook

    linear = FusedLinear(k, sizes).to(device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=k ** -0.5)
    m = LoRAMapping(torch.device("cuda"))
    hook = LoRALinearHook(linear, num_slots, rank, m, use_triton=True)
    hook.lora_a.normal_(std=k ** -0.5)
    hook.lora_b.normal_(std=0.05)
    return linear, hook, m


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_graph_replay_gives_the_eager_steps_bits(batch):
    """qkv of Llama-3-8B, 16 slots of rank 16: the hook captured in a CUDA graph (groups made on
    the device, grid fixed by batch and slots), replayed for two slot assignments written into
    its static buffer, equals eager steps of the same assignments bit for bit."""
    linear, hook, m = _gpu_hook({"q": 4096, "k": 1024, "v": 1024}, 4096)
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 4096, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(batch, 6144, device="cuda", dtype=torch.bfloat16)
    assignments = [torch.randint(-1, 16, (batch,), generator=gen).tolist() for _ in range(2)]
    for slots in assignments:
        slots[0] = 5
    slots_buf = torch.full((batch,), -1, dtype=torch.int32, device="cuda")
    work = torch.empty_like(base)

    def step():
        m.use_graph_slots(slots_buf)
        work.copy_(base)
        hook(x, work)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slots in assignments:
        slots_buf.copy_(torch.tensor(slots, dtype=torch.int32))
        graph.replay()
        m.set_step(slots, decode_only=True)
        eager = hook(x, base.clone())
        torch.cuda.synchronize()
        assert torch.equal(work, eager)
        token_slots = torch.tensor(slots, device="cuda")
        ref = lora_expand_ref(lora_shrink_ref(x, hook.lora_a, token_slots), hook.lora_b, base, hook.shards,
                              16, token_slots)
        assert_close(work, ref, torch.bfloat16, "graph step")


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_gemv_with_the_adapter_epilogue_llama8b(gated):
    """The one-token chain's qkv (norm folded) and gate_up (delta before SiLU-mul) at 8B shapes."""
    from rooflm.kernels.gemv import gemv

    sizes = {"gate": 14336, "up": 14336} if gated else {"q": 4096, "k": 1024, "v": 1024}
    linear, hook, m = _gpu_hook(sizes, 4096)
    m.set_step([7], decode_only=True)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    out = gemv(x, linear.weight, norm_weight=norm_w, eps=1e-5, gated=gated,
               lora=hook.gemv_epilogue(x, norm_w, 1e-5))
    assert_close(out, _one_token_ref(linear, hook, x, norm_w, 7, gated), torch.bfloat16, "gemv + lora")


def test_slot_tiles_cover_each_group_in_m_tiles_and_pad_with_minus_one():
    from rooflm.kernels.lora_shrink import slot_tiles

    starts = torch.tensor([0, 18, 19, 21, 21], dtype=torch.int32, device=DEVICE)  # 18, 1, 2, 0 rows
    group, row = slot_tiles(starts, num_tokens=24, block_m=16)
    assert group.tolist() == [0, 0, 1, 2, -1, -1], "min(24, ceil(24 / 16) + 4) = 6 tiles, 4 used"
    assert row.tolist()[:4] == [0, 16, 18, 19]
    assert slot_tiles(starts[:2], num_tokens=1, block_m=16)[0].tolist() == [0]


@pytest.mark.parametrize("slots,num_slots", [([2, -1, 0, 2, -1, 1, 0, 2], 4), ([3] * 20 + [-1, 0], 5), ([1], 16)])
def test_graph_groups_kernel_gives_the_torch_forms_tensors(slots, num_slots):
    """The one-launch grouping of a graph's step against graph_segments + slot_tiles."""
    from rooflm.kernels.lora_shrink import graph_groups, graph_segments, slot_tiles

    token_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    order, starts, seg_slots, (group, row) = graph_groups(token_slots, num_slots)
    want = graph_segments(token_slots, num_slots)
    assert torch.equal(order, want[0]) and torch.equal(starts, want[1]) and torch.equal(seg_slots, want[2])
    want_group, want_row = slot_tiles(want[1], len(slots), 16)
    assert torch.equal(group, want_group)
    used = group >= 0
    assert torch.equal(row[used], want_row[used])


def test_graph_groups_of_a_batch_too_wide_for_one_program_take_the_torch_form(monkeypatch):
    import rooflm.kernels.lora_shrink as shrink

    token_slots = torch.tensor([1, -1, 0, 1], dtype=torch.int32, device=DEVICE)
    want = shrink.graph_groups(token_slots, 3)
    monkeypatch.setattr(shrink, "GRAPH_GROUPS_MAX_TILE", 1)
    monkeypatch.setattr(shrink, "_graph_groups_kernel", None)  # not launched
    got = shrink.graph_groups(token_slots, 3)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
    assert torch.equal(got[3][0], want[3][0])


def test_a_steps_host_tiles_are_the_device_tables_tiles():
    from rooflm.kernels.lora_shrink import slot_tiles
    from rooflm.lora.mapping import host_tiles

    m = _mapping([1] * 40 + [-1, 0, 2, 2], decode_only=False)  # 40 rows of slot 1: 64-row tiles
    group, row = m.segments(3).tiles
    want_group, want_row = slot_tiles(m.seg_starts, m.token_order.numel(), 64)
    used = want_group >= 0
    assert torch.equal(group, want_group[used]) and torch.equal(row, want_row[used])
    g, r = host_tiles(np.array([0, 18, 19, 21]), 18, decode_only=True)
    assert g.tolist() == [0, 0, 1, 2] and r.tolist() == [0, 16, 18, 19]
