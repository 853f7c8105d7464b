"""W4A16 and W8A16 weight-only kernels (rooflm/kernels/w4a16.py, w8a16.py) against dequantize-then-matmul."""

import pytest
import torch
import triton
import triton.language as tl

from tests.kernels.helpers import DEVICE, assert_close
import rooflm.envs as envs
from rooflm.kernels.w4a16 import (W4Config, _unit_nibbles_as, _unit_nibbles_packed, _unit_nibbles_wide, pack_int4, pick_config, unpack_int4, w4a16_linear,
                                  w4a16_linear_ref)
from rooflm.kernels.w8a16 import W8Config, w8a16_linear, w8a16_linear_ref


def _w4(n, k, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (0.01 + 0.02 * torch.rand(k // group, n, generator=g)).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).to(dtype)  # asymmetric
    return pack_int4(codes, group).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), g


def test_int4_packing_round_trips_and_puts_the_halves_of_k_in_the_nibbles():
    codes = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    packed = pack_int4(codes, 32)
    assert packed.shape == (3, 128)
    assert torch.equal(unpack_int4(packed, 256), codes)
    assert int(packed[1, 5]) == int(codes[1, 5]) | (int(codes[1, 128 + 5]) << 4)


def test_int4_packing_pads_the_high_half_when_the_groups_are_odd():
    codes = torch.randint(1, 16, (2, 96), dtype=torch.uint8)  # 3 groups of 32: halves of 64 and 32 inputs
    packed = pack_int4(codes, 32)
    assert packed.shape == (2, 64)
    assert torch.equal(packed[:, 32:] >> 4, torch.zeros(2, 32, dtype=torch.uint8))
    assert torch.equal(unpack_int4(packed, 96), codes)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_w4a16_matches_reference(m, group):
    dtype = torch.float16
    n, k = 40, 256  # n not a multiple of the tile: the masks are exercised
    qw, s, z, g = _w4(n, k, group, dtype, seed=group + m)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w4a16_linear(x, qw, s, z, group), w4a16_linear_ref(x, qw, s, z, group), dtype, f"m={m} g={group}")


@pytest.mark.parametrize("cfg", [
    W4Config(1, 16, 128, 4, 3, split_k=1),   # GEMV, K steps of 2 groups
    W4Config(1, 8, 256, 4, 3, split_k=3),    # GEMV, split-K over 3 byte ranges (the last one short)
    W4Config(1, 32, 512, 4, 3, split_k=2),   # one step holds 4 groups a nibble; the step runs past S
    W4Config(1, 16, 128, 4, 3, split_k=2, fold=False),  # the GEMV with the scale and zero per weight
    W4Config(1, 8, 256, 2, 3, split_k=1, fold=False),
    W4Config(1, 16, 128, 4, 3, split_k=2, x_sums=True),  # the folded GEMV, x's group sums precomputed
    W4Config(16, 32, 256, 4, 3, split_k=2, swap_ab=True, x_sums=True),  # swap-AB fold, the same
    W4Config(16, 16, 128, 4, 3, split_k=2),  # tensor cores, split-K
    W4Config(32, 32, 256, 4, 3, split_k=1),
    W4Config(16, 32, 256, 4, 3, split_k=2, fold=False),  # tensor cores, scale and zero per weight
    # swap-AB with registers capped (spills on sm_90; the interpreter ignores the cap)
    W4Config(16, 64, 256, 4, 3, split_k=2, swap_ab=True, maxnreg=96),
], ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}{'' if c.fold else 'nofold'}"
                 f"{'swap' if c.swap_ab else ''}{f'r{c.maxnreg}' if c.maxnreg else ''}{'xs' if c.x_sums else ''}")
@pytest.mark.parametrize("k", [384, 448])  # 6 groups (halves of 192: even) and 7 (the high half padded)
def test_w4a16_configs_match_reference(cfg, k):
    """Every path of the kernel: split-K partials, steps running past the packed row (masks), an odd
    group count (high nibbles padded past K), both GEMV and tensor-core tiles."""
    dtype = torch.float16
    m = 1 if cfg.block_m == 1 else 5
    qw, s, z, g = _w4(24, k, 64, dtype, seed=k + cfg.block_k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w4a16_linear(x, qw, s, z, 64, config=cfg), w4a16_linear_ref(x, qw, s, z, 64), dtype, str(cfg))


@pytest.mark.parametrize("fold", ["fold", "nofold", "xsums"])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,block_m", [(2, 16), (16, 16), (33, 32), (64, 64)])
@pytest.mark.parametrize("k,group", [(384, 64), (448, 64), (512, 128)])  # even; the high half padded; g 128
def test_w4a16_swap_ab_matches_reference(m, block_m, split_k, fold, k, group):
    """The swapped tensor-core tiles (y.T = W @ x.T, W the MMA's A operand): rows of x past M and
    of W past N masked (N = 40), split-K partials, the per-group fold (x's group sums in the kernel
    or precomputed) and the per-weight scale."""
    dtype = torch.float16
    qw, s, z, g = _w4(40, k, group, dtype, seed=k + m + split_k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    cfg = W4Config(block_m, 32, 2 * group, 4, 3, split_k=split_k, fold=fold != "nofold", swap_ab=True,
                   x_sums=fold == "xsums")
    assert_close(w4a16_linear(x, qw, s, z, group, config=cfg), w4a16_linear_ref(x, qw, s, z, group), dtype, str(cfg))


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "nofold"])
def test_w4a16_swap_ab_fp32_strided_and_fractional_zeros(fold):
    """fp32 activations (full-precision dots) through the swapped tiles, x with a row stride, and
    zero points that are not integers."""
    qw, s, z, g = _w4(48, 256, 32, torch.float32)
    z = z + 0.37
    x = torch.randn(17, 512, generator=g).to(DEVICE)[:, ::2]
    cfg = W4Config(16, 16, 128, 4, 3, split_k=2, fold=fold, swap_ab=True)
    assert_close(w4a16_linear(x, qw, s, z, 32, config=cfg), w4a16_linear_ref(x, qw, s, z, 32), torch.float32)


def test_w4a16_swap_ab_is_a_table_field_old_tables_lack():
    """Tabled configs load with swap_ab or without it (tables written before it: off), and a GEMV
    tile cannot take it."""
    old = dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=1, fold=True)
    assert W4Config(**old).swap_ab is False
    assert W4Config(**dict(old, swap_ab=True))._asdict()["swap_ab"] is True
    qw, s, z, g = _w4(16, 128, 64, torch.float16)
    x = torch.randn(1, 128, generator=g).to(torch.float16).to(DEVICE)
    with pytest.raises(ValueError, match="swap_ab"):
        w4a16_linear(x, qw, s, z, 64, config=W4Config(1, 16, 128, 4, 3, swap_ab=True))


def _two_ways(*args, **kwargs):
    """w4a16_linear with the split-K sum in the kernel (each tile's last split program) and with
    split_k_reduce's second launch (ROOFLM_W4_FUSED_REDUCE=0)."""
    with envs.override("ROOFLM_W4_FUSED_REDUCE", "1"):
        fused = w4a16_linear(*args, **kwargs)
    with envs.override("ROOFLM_W4_FUSED_REDUCE", "0"):
        two = w4a16_linear(*args, **kwargs)
    return fused, two


def _counters_are_zero(device: torch.device) -> bool:
    """The split-K tile counters of device (a tensor's device: cuda:0, not cuda) are all zero."""
    from rooflm.kernels.split_k import _COUNTERS
    return int(_COUNTERS[device].abs().sum()) == 0


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("block_m,swap_ab", [(1, False), (16, False), (16, True)], ids=["gemv", "tc", "swap"])
def test_w4a16_fused_split_sum_is_bitwise_the_two_launches(block_m, swap_ab, split_k):
    """The last of a tile's split programs sums the partials in split_k_reduce's order: the same bits
    as the second launch, for the GEMV and both tensor-core tiles; and it leaves the tile counters at
    zero, so a second call (a CUDA graph's next replay) sums right again."""
    dtype = torch.float16
    m = 1 if block_m == 1 else 16
    k, group = 1536, 64  # 12 steps of 64 bytes: 2, 3 and 4 splits of whole steps
    qw, s, z, g = _w4(40, k, group, dtype, seed=split_k + block_m)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    cfg = W4Config(block_m, 16 if block_m == 1 else 32, 2 * group, 4, 3, split_k=split_k, swap_ab=swap_ab)
    fused, two = _two_ways(x, qw, s, z, group, config=cfg)
    assert torch.equal(fused, two), str(cfg)
    assert_close(fused, w4a16_linear_ref(x, qw, s, z, group), dtype, str(cfg))
    assert _counters_are_zero(x.device)
    x2 = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    again, two = _two_ways(x2, qw, s, z, group, config=cfg)
    assert torch.equal(again, two) and _counters_are_zero(x.device)
    assert torch.equal(w4a16_linear(x, qw, s, z, group, config=cfg), fused)


def test_x_group_sums_and_the_configs_that_may_use_them():
    """x_group_sums: each row's fp32 sum over each group (rows strided); x_sums only with the fold
    on the GEMV or the swapped tiles."""
    from rooflm.kernels.w4a16 import x_group_sums
    x = torch.randn(3, 2 * 448, dtype=torch.float16).to(DEVICE)[:, :448]  # 7 groups of 64, a row stride
    assert torch.allclose(x_group_sums(x, 64).cpu(), x.float().cpu().view(3, 7, 64).sum(-1), atol=1e-4)
    qw, s, z, g = _w4(16, 256, 64, torch.float16)
    xx = torch.randn(2, 256, generator=g).to(torch.float16).to(DEVICE)
    for bad in (W4Config(16, 32, 128, 4, 3, x_sums=True), W4Config(1, 16, 128, 4, 3, fold=False, x_sums=True)):
        with pytest.raises(ValueError, match="x_sums"):
            w4a16_linear(xx, qw, s, z, 64, config=bad)


def test_tile_counters_grow_but_never_free_what_a_graph_may_hold():
    """A launch with more tiles than counters gets a new, larger tensor; the old one is kept alive
    (a captured CUDA graph still holds its address)."""
    from rooflm.kernels import split_k
    device = torch.zeros(1, device=DEVICE).device
    small = split_k.tile_counters(device, 1)
    grown = split_k.tile_counters(device, small.numel() + 1)
    assert grown.numel() > small.numel() and int(grown.abs().sum()) == 0
    assert any(t is small for t in split_k._RETIRED)
    assert split_k.tile_counters(device, 1) is grown


@triton.jit
def _unpack_units(p_ptr, o_ptr, DT: tl.constexpr, PACKED: tl.constexpr = False):
    r = tl.arange(0, 256)
    if PACKED:  # the inline-PTX unpacking (compiled only)
        low, high = _unit_nibbles_packed(tl.load(p_ptr + r), DT)
    else:
        low, high = _unit_nibbles_as(tl.load(p_ptr + r), DT)
    tl.store(o_ptr + r, low.to(tl.float32))
    tl.store(o_ptr + 256 + r, high.to(tl.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unit_nibbles_are_exact_in_each_activation_dtype(dtype):
    """1 + code / 16 built from bits (the tensor-core path multiplies it as it is) for both nibbles."""
    p = torch.arange(256, dtype=torch.uint8).to(DEVICE)  # every byte
    out = torch.zeros(512, device=DEVICE)
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    _unpack_units[(1,)](p, out, DT=tl_dtype)
    expected = torch.cat([1 + (p & 15).float() / 16, 1 + (p >> 4).float() / 16])
    assert torch.equal(out, expected)


@triton.jit
def _unpack_wide(p_ptr, o_ptr, ASM: tl.constexpr):
    r = tl.arange(0, 256)
    low, high = _unit_nibbles_wide(tl.load(p_ptr + r), ASM)
    tl.store(o_ptr + r, low)
    tl.store(o_ptr + 256 + r, high)


def test_wide_unit_nibbles_put_the_low_code_at_a_256th_and_the_high_at_a_16th():
    """The folded GEMV's values: 1 + low / 256 and 1 + high / 16 in fp32, exact, for every byte."""
    p = torch.arange(256, dtype=torch.uint8).to(DEVICE)
    out = torch.zeros(512, device=DEVICE)
    _unpack_wide[(1,)](p, out, ASM=False)
    assert torch.equal(out, torch.cat([1 + (p & 15).float() / 256, 1 + (p >> 4).float() / 16]))


@pytest.mark.gpu
def test_wide_packed_unit_nibbles_match_the_triton_ones_for_every_byte():
    """The inline-PTX wide unpacking (a shift and two lop3 a byte, four bytes a register) gives
    each byte's two values in its own place (compiled only)."""
    p = torch.arange(256, dtype=torch.uint8).flip(0).contiguous().to(DEVICE)
    out = torch.zeros(512, device=DEVICE)
    _unpack_wide[(1,)](p, out, ASM=True)
    assert torch.equal(out, torch.cat([1 + (p & 15).float() / 256, 1 + (p >> 4).float() / 16]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_unit_nibbles_match_the_triton_ones_for_every_byte(dtype):
    """The inline-PTX unpacking (prmt, shift, lop3 on four bytes at a time) gives each byte's two
    values in its own place, the same as _unit_nibbles_as (compiled only: no inline asm under the
    interpreter)."""
    p = torch.arange(256, dtype=torch.uint8).flip(0).contiguous().to(DEVICE)  # every byte, not in order
    out = torch.zeros(512, device=DEVICE)
    _unpack_units[(1,)](p, out, DT={torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype], PACKED=True)
    expected = torch.cat([1 + (p & 15).float() / 16, 1 + (p >> 4).float() / 16])
    assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    W4Config(16, 64, 256, 4, 3, split_k=2), W4Config(16, 64, 256, 4, 3, split_k=3, swap_ab=True),
    W4Config(64, 128, 256, 8, 3, swap_ab=True), W4Config(32, 64, 256, 4, 3),
    W4Config(1, 64, 256, 2, 4, split_k=2), W4Config(1, 32, 256, 4, 4, split_k=4),  # the folded GEMV
], ids=lambda c: f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.split_k}{'swap' if c.swap_ab else ''}")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_w4a16_packed_unpacking_is_bitwise_the_triton_unpacking(cfg, m):
    """ROOFLM_W4_ASM on and off give the same bits: the values are exact either way."""
    dtype = torch.bfloat16
    qw, s, z, g = _w4(4096, 4096, 128, dtype, seed=m + 7)
    x = torch.randn(m, 4096, generator=g).to(dtype).to(DEVICE)
    with envs.override("ROOFLM_W4_ASM", "1"):
        y_asm = w4a16_linear(x, qw, s, z, 128, config=cfg)
    with envs.override("ROOFLM_W4_ASM", "0"):
        y_tl = w4a16_linear(x, qw, s, z, 128, config=cfg)
    assert torch.equal(y_asm, y_tl)
    assert_close(y_asm, w4a16_linear_ref(x, qw, s, z, 128), dtype, str(cfg))


_H100 = "NVIDIA H100 80GB HBM3"
_LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", _LLAMA3_8B, ids=["qkv", "o", "gate_up", "down"])
def test_w4a16_fused_split_sum_bitwise_on_the_h100_tiles_and_in_a_cuda_graph(n, k, m):
    """The H100 table's tiles (on any GPU) for the Llama-3-8B shapes: the split sum in the kernel
    gives the bits of the second launch, eagerly and from a CUDA graph replayed twice with new x
    (the tile counters reset between replays), with PDL where the GPU has it."""
    from rooflm.kernels.tuned_configs import lookup
    dtype = torch.bfloat16
    cfg = W4Config(**lookup("w4a16", _H100, n, k, m, 128))
    qw, s, z, g = _w4(n, k, 128, dtype, seed=m + n + k)
    xs = [torch.randn(m, k, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    fused, two = _two_ways(xs[0], qw, s, z, 128, config=cfg)
    assert torch.equal(fused, two), str(cfg)
    assert_close(fused, w4a16_linear_ref(xs[0], qw, s, z, 128), dtype, str(cfg))
    eager = [w4a16_linear(x, qw, s, z, 128, config=cfg) for x in xs]
    static_x = xs[0].clone()
    w4a16_linear(static_x, qw, s, z, 128, config=cfg)  # warm-up: compiled, counters allocated
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = w4a16_linear(static_x, qw, s, z, 128, config=cfg)
    for x, want in zip(xs[1:], eager[1:]):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, want), f"{cfg} replay"
    assert _counters_are_zero(static_x.device)


def test_w4a16_fractional_zero_points_stay_exact():
    """The kernel subtracts 1 + zero / 16 from 1 + code / 16: a zero point that is not an integer
    (a float zero in code units) is kept as it is, not rounded into the code."""
    qw, s, z, g = _w4(16, 128, 32, torch.float32)
    z = z + 0.37
    for m in (1, 3):  # the GEMV and the tensor-core path
        x = torch.randn(m, 128, generator=g).to(DEVICE)
        assert_close(w4a16_linear(x, qw, s, z, 32), w4a16_linear_ref(x, qw, s, z, 32), torch.float32)


def test_w4a16_pick_config_reads_the_tile_table():
    from rooflm.kernels.tuned_configs import lookup
    entry = dict(block_m=1, block_n=32, block_k=512, num_warps=8, num_stages=4, split_k=2)
    table = {"GPU-X": {"w4a16": [dict(n=4096, k=4096, group=128, m=1, config=entry),
                                 dict(n=4096, k=4096, group=128, m=16, config=dict(entry, block_m=16))]}}
    assert lookup("w4a16", "GPU-X", 4096, 4096, 1, 128, table=table) == entry
    assert lookup("w4a16", "GPU-X", 4096, 4096, 9, 128, table=table)["block_m"] == 16  # next tabled M up
    assert lookup("w4a16", "GPU-X", 4096, 4096, 64, 128, table=table)["block_m"] == 16  # beyond: the largest
    assert lookup("w4a16", "GPU-X", 4096, 4096, 1, 64, table=table) is None  # another group size
    assert lookup("w4a16", "GPU-Y", 4096, 4096, 1, 128, table=table) is None
    # No table entry: the heuristic splits K for a narrow N so that ~2 programs run per SM.
    assert pick_config(1, 4096, 4096, 128, None, 132).split_k == 3  # 128 row blocks of 32
    assert pick_config(1, 28672, 4096, 128, None, 132).split_k == 1


def test_w4a16_rejects_configs_it_cannot_run():
    qw, s, z, g = _w4(16, 128, 64, torch.float16)
    x = torch.randn(1, 128, generator=g).to(torch.float16).to(DEVICE)
    with pytest.raises(ValueError, match="whole groups"):
        w4a16_linear(x, qw, s, z, 64, config=W4Config(1, 16, 64, 4, 3))
    with pytest.raises(ValueError, match="block_n >= 16"):
        w4a16_linear(x, qw, s, z, 64, config=W4Config(16, 8, 128, 4, 3))
    with pytest.raises(ValueError, match="maxnreg"):
        w4a16_linear(x, qw, s, z, 64, config=W4Config(16, 16, 128, 4, 3, maxnreg=8))


def test_w4a16_fp32_and_strided_input():
    qw, s, z, g = _w4(32, 128, 32, torch.float32)
    x = torch.randn(2, 256, generator=g).to(DEVICE)[:, ::2]  # non-contiguous rows
    assert_close(w4a16_linear(x, qw, s, z, 32), w4a16_linear_ref(x, qw, s, z, 32), torch.float32)


def test_w4a16_rejects_bad_shapes():
    qw, s, z, _ = _w4(16, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_linear(torch.zeros(1, 128, dtype=torch.float16, device=DEVICE), qw, s, z, 32)
    with pytest.raises(ValueError, match="scales and zeros"):
        w4a16_linear(torch.zeros(1, 64, dtype=torch.float16, device=DEVICE), qw, s[:1], z, 32)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("with_zero", [False, True])
def test_w8a16_matches_reference(m, with_zero):
    dtype = torch.float16
    g = torch.Generator().manual_seed(m + 10 * with_zero)
    n, k = 24, 200  # K not a multiple of the tile
    qw = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    s = (0.001 + 0.002 * torch.rand(n, generator=g)).to(dtype).to(DEVICE)
    z = torch.randint(-8, 8, (n,), generator=g).to(dtype).to(DEVICE) if with_zero else None
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w8a16_linear(x, qw, s, z), w8a16_linear_ref(x, qw, s, z), dtype, f"m={m} zero={with_zero}")


@pytest.mark.parametrize("cfg", [
    W8Config(1, 16, 64, 4, 3, split_k=1),
    W8Config(1, 8, 32, 4, 3, split_k=3),     # split-K, the last range holding K's tail
    W8Config(1, 32, 128, 4, 3, split_k=1),   # K = 256: no tail (the unmasked path)
    W8Config(16, 16, 32, 4, 3, split_k=2),   # tensor cores, split-K
], ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("k", [200, 256])
def test_w8a16_configs_match_reference(cfg, k):
    dtype = torch.float16
    g = torch.Generator().manual_seed(k + cfg.block_k)
    m, n = (1 if cfg.block_m == 1 else 5), 24
    qw = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)  # -128 too
    s = (0.001 + 0.002 * torch.rand(n, generator=g)).to(dtype).to(DEVICE)
    z = torch.randint(-8, 8, (n,), generator=g).to(dtype).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w8a16_linear(x, qw, s, z, config=cfg), w8a16_linear_ref(x, qw, s, z), dtype, str(cfg))


def _w8_grouped(n, k, group, dtype, seed, with_zero=False):
    g = torch.Generator().manual_seed(seed)
    qw = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    s = (0.001 + 0.02 * torch.rand(k // group, n, generator=g)).to(dtype).to(DEVICE)  # one a group: varied
    z = torch.randint(-8, 8, (k // group, n), generator=g).to(dtype).to(DEVICE) if with_zero else None
    return qw, s, z, g


@pytest.mark.parametrize("cfg", [
    None,                                     # pick_config's heuristic (block_k raised to the group)
    W8Config(1, 16, 64, 4, 3, split_k=1),     # GEMV, two groups a tile
    W8Config(1, 8, 32, 4, 3, split_k=3),      # one group a tile, split-K
    W8Config(1, 32, 128, 4, 3, split_k=2),    # the last tile runs past K (K = 224: 7 groups)
    W8Config(16, 16, 64, 4, 3, split_k=2),    # tensor cores, split-K
    W8Config(16, 32, 32, 4, 3, split_k=1),
], ids=lambda c: "heuristic" if c is None else f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("with_zero", [False, True])
def test_w8a16_group_scales_match_reference(cfg, with_zero):
    """Group-wise scales (GGUF Q8_0: one per 32 inputs): each group's sum scaled by its own scale."""
    dtype = torch.float16
    n, k, group = 24, 224, 32
    qw, s, z, g = _w8_grouped(n, k, group, dtype, seed=7 + with_zero, with_zero=with_zero)
    for m in ((1, 5) if cfg is None else ((1,) if cfg.block_m == 1 else (5,))):
        x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
        ref = w8a16_linear_ref(x, qw, s, z, group_size=group)
        assert_close(w8a16_linear(x, qw, s, z, config=cfg, group_size=group), ref, dtype, f"{cfg} m={m}")
    # and the reference is what it says: per-channel scales repeated per group give the per-channel result
    per_row = s[0].clone()
    same = per_row.expand(k // group, n).contiguous()
    assert torch.equal(w8a16_linear_ref(x, qw, same, None, group_size=group), w8a16_linear_ref(x, qw, per_row))


def test_w8a16_group_scales_reject_bad_shapes():
    qw, s, _, g = _w8_grouped(16, 64, 32, torch.float16, seed=1)
    x = torch.randn(1, 64, generator=g).to(torch.float16).to(DEVICE)
    with pytest.raises(ValueError, match=r"must be \[2, 16\]"):
        w8a16_linear(x, qw, s[:1], group_size=32)
    with pytest.raises(ValueError, match="group_size 24"):
        w8a16_linear(x, qw, s, group_size=24)
    with pytest.raises(ValueError, match="whole groups"):
        w8a16_linear(x, qw, s, config=W8Config(1, 16, 16, 4, 3), group_size=32)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_weight_only_bf16_large(m, n, k):
    """The Llama-3-8B shapes in bf16, compiled (tl.dot on bf16 is wrong only in the interpreter)."""
    dtype = torch.bfloat16
    qw, s, z, g = _w4(n, k, 128, dtype, seed=m)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w4a16_linear(x, qw, s, z, 128), w4a16_linear_ref(x, qw, s, z, 128), dtype, "w4")
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    s8 = (0.001 * torch.rand(n, generator=g) + 1e-4).to(dtype).to(DEVICE)
    assert_close(w8a16_linear(x, q8, s8), w8a16_linear_ref(x, q8, s8), dtype, "w8")
    s32 = (0.001 * torch.rand(k // 32, n, generator=g) + 1e-4).to(dtype).to(DEVICE)  # GGUF Q8_0's groups
    assert_close(w8a16_linear(x, q8, s32, group_size=32), w8a16_linear_ref(x, q8, s32, group_size=32), dtype,
                 "w8 g32")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    W4Config(16, 64, 256, 4, 3, split_k=3, swap_ab=True),
    W4Config(64, 64, 256, 4, 3, split_k=1, fold=False, swap_ab=True),
    W4Config(64, 128, 256, 8, 3, split_k=2, swap_ab=True),
], ids=lambda c: f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.split_k}{'' if c.fold else 'nofold'}")
@pytest.mark.parametrize("m", [16, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
def test_w4a16_swap_ab_bf16_large(cfg, m, n, k):
    """The swapped tiles compiled (wgmma, its A operand from registers) on the 8B shapes in bf16."""
    dtype = torch.bfloat16
    qw, s, z, g = _w4(n, k, 128, dtype, seed=m + 1)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    assert_close(w4a16_linear(x, qw, s, z, 128, config=cfg), w4a16_linear_ref(x, qw, s, z, 128), dtype, str(cfg))


@pytest.mark.parametrize("act_order", [False, True])
def test_linear_methods_match_dequantized_weights(act_order):
    """W4A16Linear / W8A16Linear (what a Linear holds on CUDA) against x @ W.T with W decoded from the
    GPTQ tensors: act-order's permutation of the inputs included."""
    from rooflm.quant import formats
    from rooflm.quantize.gptq import gptq_quantize
    from rooflm.quant.linear_method import W4A16Linear, W8A16Linear
    from rooflm.quant.rtn import rtn_int8
    g = torch.Generator().manual_seed(7)
    n, k = 32, 128
    x_cal = torch.randn(64, k, generator=g) * torch.linspace(0.2, 2.0, k)
    w = torch.randn(n, k, generator=g)
    q = gptq_quantize(w, x_cal.T @ x_cal, 4, 32, act_order=act_order)
    t = formats.to_gptq(q, 4)
    loaded = formats.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32)
    assert (loaded.perm is not None) == act_order
    x = torch.randn(3, k, generator=g).to(torch.float16)
    for m in (1, 3):
        out = W4A16Linear(loaded, torch.device(DEVICE), torch.float16)(x[:m].to(DEVICE))
        ref = (x[:m].float() @ loaded.dequantize().T).to(torch.float16)
        assert_close(out.cpu(), ref, torch.float16, f"w4 m={m}")
    q8 = rtn_int8(w)
    out = W8A16Linear(q8, torch.device(DEVICE), torch.float16)(x.to(DEVICE))
    assert_close(out.cpu(), (x.float() @ q8.dequantize().T).to(torch.float16), torch.float16, "w8")


# Compiled for the H100 (sm_90) on a machine without one (Triton's NVIDIA backend and ptxas run
# offline): pick_config's tiles for the Llama-3-8B shapes build, fit the H100's 227 KB of shared
# memory, do not spill, and the GEMVs keep their cp.async pipeline (tl.range num_stages; without
# it the batch-1 stream is latency-bound). A subprocess: this process's kernels are the
# interpreter's when there is no GPU.
_SM90_COMPILE = """
import re, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas
from benchmarks.quant_gemv_sass import compile_kernel
import rooflm.envs as envs
from rooflm.kernels import w4a16, w8a16
from rooflm.kernels.tuned_configs import lookup

def spills(ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    found = re.findall(r"(\\d+) bytes spill stores", out)
    assert found, out  # ptxas -v reports the spills of every function it compiles
    return sum(int(n) for n in found)

act = dict(y_ptr="bf16", x_ptr="bf16", xs_ptr="fp32", s_ptr="bf16", z_ptr="bf16", ws_ptr="fp32", count_ptr="i32")

def w4(c, m):
    # as an H100 launch compiles it: PDL, the split sum in the kernel, M == 1 a constexpr
    return compile_kernel(w4a16._w4a16_kernel, dict(act, qw_ptr="u8"),
                          dict(GROUP=128, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_H=c.block_k // 2,
                               SPLIT=c.split_k > 1, EVEN=True, PRECISION="tf32", STAGES=c.num_stages,
                               FOLD=c.fold, SWAP_AB=c.swap_ab, ASM=envs.get('ROOFLM_W4_ASM'), PDL=True,
                               FUSED=c.split_k > 1 and envs.get('ROOFLM_W4_FUSED_REDUCE'), **({"M": 1} if m == 1 else {})),
                          c.num_warps, c.num_stages)

for m in (1, 16, 64):
    for n, k in ((4096, 4096), (4096, 14336)):
        c = w4a16.pick_config(m, n, k, 128, None, 132)
        kern = w4(c, m)
        ptx = kern.asm["ptx"]
        assert kern.metadata.shared <= 227 * 1024, (c, kern.metadata.shared)
        assert spills(ptx) == 0, f"w4a16 {c} spills"
        assert m > 1 or "cp.async" in ptx, f"w4a16 GEMV {c} lost its load pipeline"
        c = w8a16.pick_config(m, n, k, None, 132)
        kern = compile_kernel(w8a16._w8a16_kernel, dict(act, qw_ptr="i8"),
                              dict(HAS_ZERO=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                                   SPLIT=c.split_k > 1, EVEN_K=True, PRECISION="tf32", STAGES=c.num_stages),
                              c.num_warps, c.num_stages)
        assert kern.metadata.shared <= 227 * 1024, (c, kern.metadata.shared)
        assert spills(kern.asm["ptx"]) == 0, f"w8a16 {c} spills"
        assert m > 1 or "cp.async" in kern.asm["ptx"], f"w8a16 GEMV {c} lost its load pipeline"
# the H100 table's batch-1 tiles: the split sum's acquire-release counter is there, and no spills
for n, k in ((4096, 4096), (28672, 4096)):
    c = w4a16.W4Config(**lookup("w4a16", "NVIDIA H100 80GB HBM3", n, k, 1, 128))
    ptx = w4(c, 1).asm["ptx"]
    assert spills(ptx) == 0, f"w4a16 {c} spills"
    assert c.split_k == 1 or "atom.global.gpu.acq_rel.add" in ptx, c
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, c
print("ok")
"""


# The swapped tiles' point: the unpacked W reaches wgmma from registers (HGMMA's A operand a
# register, not a shared-memory descriptor), and ptxas keeps the wgmma chain asynchronous (no
# info C7515, "wgmma.mma_async instructions are serialized"), without spills.
_SM90_SWAP_AB = """
import re, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas
from benchmarks.quant_gemv_sass import compile_kernel, cuobjdump
import rooflm.envs as envs
from rooflm.kernels import w4a16

act = dict(y_ptr="bf16", x_ptr="bf16", xs_ptr="fp32", s_ptr="bf16", z_ptr="bf16", ws_ptr="fp32", qw_ptr="u8", count_ptr="i32")
for c in (w4a16.W4Config(16, 64, 256, 4, 3, swap_ab=True),
          w4a16.W4Config(64, 64, 256, 4, 3, 2, fold=False, swap_ab=True)):
    kern = compile_kernel(w4a16._w4a16_kernel, act,
                          dict(GROUP=128, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_H=c.block_k // 2,
                               SPLIT=c.split_k > 1, EVEN=True, PRECISION="tf32", STAGES=c.num_stages,
                               FOLD=c.fold, SWAP_AB=True, ASM=envs.get('ROOFLM_W4_ASM'), FUSED=c.split_k > 1),
                          c.num_warps, c.num_stages)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kern.asm["ptx"])
        f.flush()
        info = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                              capture_output=True, text=True, check=True).stderr
    assert "C7515" not in info, (c, info)
    assert sum(int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)) == 0, (c, info)
    hgmma = re.findall(r"HGMMA\\.\\S+ (\\S+), (\\S+),", cuobjdump(kern, "-sass"))
    assert hgmma and all(a.startswith("R") for _, a in hgmma), (c, hgmma[:4])
print("ok")
"""


def _run_offline(script: str) -> None:
    """script in a subprocess without TRITON_INTERPRET (compiled for real), from the repo root."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], env=dict(env, PYTHONPATH=root), cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_pick_config_tiles_compile_for_sm90_without_spills():
    _run_offline(_SM90_COMPILE)


def test_swap_ab_tiles_feed_wgmma_from_registers_on_sm90():
    _run_offline(_SM90_SWAP_AB)
