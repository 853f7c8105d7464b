"""Batch invariance of the --deterministic kernels (rooflm/deterministic/): a row's result is
bit-identical whatever else is in the launch. Under Triton's interpreter on the CPU (small
shapes, fp16/fp32); compiled, with bf16 and model-sized shapes, on a GPU."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close, random_paged_batch
from rooflm.kernels.matmul_fixed_split import (matmul_fixed_split, matmul_fixed_split_ref, split_plan,
                                               split_size)
from rooflm.kernels.matmul_persistent import matmul_config, matmul_persistent, matmul_ref
from rooflm.layers.cuda_attention import TritonBackend
from rooflm.kernels.prefill_attention import (PrefillPlan, prefill_attention, prefill_attention_ref, prefill_config,
                                              uniform_decode_config)
from rooflm.kernels.rmsnorm import rmsnorm
from rooflm.kernels.utils import num_sms
from rooflm.layers.attention import AttentionMetadata


def rows_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise (NaNs included), not numerically."""
    return torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32))


# ---- matmul ---------------------------------------------------------------------------------

def check_matmul_rows(m_big, n, k, dtype, subsets, bias):
    x = torch.randn(m_big, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    full = matmul_persistent(x, w, b)
    assert_close(full, matmul_ref(x, w, b), dtype, "matmul")
    for lo, hi in subsets:
        part = matmul_persistent(x[lo:hi].clone(), w, b)
        assert rows_equal(part, full[lo:hi]), f"rows {lo}:{hi} of M={m_big} differ when run as M={hi - lo}"


# What the interpreter can and cannot show: a tile's tl.dot is numpy's matmul there, which casts
# fp16 operands to fp32 and calls BLAS, whose sums depend on a row's place in the tile (its
# micro-kernel tails): an interpreter artefact, not the GPU's. So the CPU cases draw values whose
# products and sums are exact in fp32 (small multiples of powers of two; exact_values below):
# every dot is then exact in any order, and what is left to differ is everything around the
# dots (tiling, masks, key ranges and their order, softmax rescaling), which is what these
# tests check on the CPU. The summation order inside the matrix units is checked by the GPU
# cases (random bf16, model shapes).
@pytest.fixture
def split_on():
    """The fixed split as ROOFLM_DETERMINISTIC_MAX_SPLITS=8 sets it (it is off by default)."""
    import rooflm.envs as envs
    with envs.override("ROOFLM_DETERMINISTIC_MAX_SPLITS", "8"):
        yield


def exact_values(*shape, scale=0.5):
    """Values in {-1, 0, 1} * scale, fp16: dot products of them are exact in fp32."""
    return (torch.randint(-1, 2, shape, device=DEVICE) * scale).half()


def test_matmul_row_is_the_same_for_every_m():
    # Rows alone (M = 1), in a partial tile, across tile boundaries, at another tile offset.
    x, w, b = exact_values(40, 80), exact_values(72, 80), exact_values(72)
    full = matmul_persistent(x, w, b)
    assert torch.equal(full, matmul_ref(x, w, b))  # exact inputs: exact result
    for lo, hi in [(0, 1), (7, 8), (39, 40), (3, 20), (16, 33)]:
        assert rows_equal(matmul_persistent(x[lo:hi].clone(), w, b), full[lo:hi]), (lo, hi)


def test_matmul_tma_loads_give_the_pointer_loads_rows():
    # The same tiles through TMA descriptors (zeros past the edges, emulated by the interpreter):
    # rows at every M equal the pointer kernel's, a bias and partial tiles included.
    x, w, b = exact_values(40, 80), exact_values(72, 80), exact_values(72)
    full = matmul_persistent(x, w, b)
    assert torch.equal(matmul_persistent(x, w, b, tma=True), full)
    for lo, hi in [(0, 1), (7, 8), (3, 20)]:
        assert rows_equal(matmul_persistent(x[lo:hi].clone(), w, b, tma=True), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matmul_matches_reference(dtype):
    x, w, b = torch.randn(19, 70, device=DEVICE), torch.randn(33, 70, device=DEVICE), torch.randn(33, device=DEVICE)
    x, w, b = x.to(dtype), (w / 8).to(dtype), b.to(dtype)
    assert_close(matmul_persistent(x, w, b), matmul_ref(x, w, b), dtype, "matmul")


def test_matmul_input_checks():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="K"):
        matmul_persistent(x, torch.randn(4, 9, device=DEVICE))
    with pytest.raises(TypeError, match="share"):
        matmul_persistent(x, torch.randn(4, 8, device=DEVICE).half())
    assert matmul_persistent(x[:0], torch.randn(4, 8, device=DEVICE)).shape == (0, 4)


def test_matmul_config_narrow_decode_tiles_only_where_they_fill_the_gpu(monkeypatch):
    import rooflm.kernels.matmul_persistent as mp
    monkeypatch.setattr(mp, "is_interpreter", lambda: False)
    bucket, narrow = mp.MATMUL_BUCKETS[torch.bfloat16][0][1], mp.NARROW_DECODE_CONFIGS[torch.bfloat16]
    assert narrow[2] == bucket[2]  # the K loop, and so every row's sums, is the bucket's
    batch1 = mp.BATCH1_CONFIGS[torch.bfloat16]
    assert matmul_config(torch.bfloat16, 17, 4096, 132) == narrow  # o, down: 64 tiles of 64 for 132 SMs
    assert matmul_config(torch.bfloat16, 64, 4096, 132) == narrow
    assert matmul_config(torch.bfloat16, 1, 4096, 132) == batch1  # up to 16 rows: their own tiles
    assert matmul_config(torch.bfloat16, 16, 28672, 132) == batch1  # gate_up: 448 tiles
    assert matmul_config(torch.bfloat16, 1, 6144, 132) == bucket  # qkv: 96 tiles, 192 narrow ones
    assert matmul_config(torch.bfloat16, 17, 28672, 132) == bucket
    assert matmul_config(torch.bfloat16, 1, 4096, 100) == bucket
    assert matmul_config(torch.bfloat16, 65, 4096, 132) == mp.MATMUL_BUCKETS[torch.bfloat16][1][1]
    assert matmul_config(torch.float32, 1, 4096, 132) == mp.MATMUL_BUCKETS[torch.float32][0][1]
    with pytest.raises(ValueError, match="BLOCK_K"):
        mp.check_buckets(mp.MATMUL_BUCKETS, {torch.bfloat16: (64, 32, 128, 8, 4, 4)})


def test_matmul_config_prefill_tiles_follow_the_waves(monkeypatch):
    """Above the decode bucket: 128 x 256 or 128 x 128 tiles by how they fill the SMs, as the
    H100 ran Llama-3-8B's projections at M = 512 and 2048 (the faster of each pair)."""
    import rooflm.kernels.matmul_persistent as mp
    monkeypatch.setattr(mp, "is_interpreter", lambda: False)
    shapes = {"qkv": 6144, "o": 4096, "gate_up": 28672, "down": 4096}
    faster = {512: {"qkv": 256, "o": 128, "gate_up": 256, "down": 128},
              2048: {"qkv": 256, "o": 256, "gate_up": 256, "down": 256}}
    for m, by_shape in faster.items():
        for name, block_n in by_shape.items():
            config = matmul_config(torch.bfloat16, m, shapes[name], 132)
            assert config[1] == block_n and config[2] == 64, (m, name, config)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (4096, 4096)])
def test_matmul_gpu_bf16_rows_invariant(n, k):
    """The Llama-3-8B projections in bf16: one token alone, in a decode batch, in a prefill chunk."""
    check_matmul_rows(2048, n, k, torch.bfloat16, [(0, 1), (5, 6), (0, 64), (100, 356), (1000, 2048)],
                      bias=False)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_matmul_gpu_tma_rows_equal_pointer_rows(n, k):
    """TMA loads change how tiles arrive, not the sums: rows bitwise equal to the pointer
    kernel's at M = 2048 and to a token run alone (M = 1, the decode bucket)."""
    x = torch.randn(2048, k, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    full = matmul_persistent(x, w)
    with_tma = matmul_persistent(x, w, tma=True)
    assert torch.equal(with_tma, full)
    assert rows_equal(matmul_persistent(x[7:8].clone(), w), with_tma[7:8])


# ---- fixed-split matmul: split count from the weight, order fixed by it -----------------------

def graded_values(m, n, k, block_k, seed=0):
    """fp32 x in {-1, 0, 1} and W = {-1, 0, 1} * 2^e, one e in [-20, 20] per BLOCK_K step of K.

    Every step's dot is exact (at most BLOCK_K terms of one power of two), so BLAS and the
    interpreter agree on it; the adds across steps and splits are not (exponents 40 apart), so
    the result depends on the order of the sums, which is what these tests compare."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (m, k), generator=g).float()
    exps = torch.randint(-20, 21, (cdiv_(k, block_k),), generator=g).repeat_interleave(block_k)[:k]
    w = torch.randint(-1, 2, (n, k), generator=g).float() * torch.pow(2.0, exps.float())
    return x.to(DEVICE), w.to(DEVICE)


def cdiv_(a, b):
    return (a + b - 1) // b


# K = 200: seven BLOCK_K = 32 steps under the interpreter, three splits of 3, 3 and 1 steps (the
# last step partial); N = 72: tiles partly past N.
@pytest.mark.parametrize("schedule", ["programs", "loop"])
def test_fixed_split_matches_its_order_bitwise_at_every_m(schedule):
    block_k = matmul_config(torch.float32, 1)[2]
    x, w = graded_values(200, 72, 200, block_k)
    b = torch.randn(72, device=DEVICE)
    ref = matmul_fixed_split_ref(x, w, b, splits=3, block_k=block_k)
    # The test can fail: on these inputs the split order gives other bits than one K loop.
    assert not torch.equal(ref, matmul_fixed_split_ref(x, w, b, splits=1, block_k=block_k))
    assert not torch.equal(ref, matmul_persistent(x, w, b))
    for m in (1, 3, 64, 200):
        out = matmul_fixed_split(x[:m].clone(), w, b, splits=3, schedule=schedule)
        assert rows_equal(out, ref[:m]), f"{schedule} M={m}"
    # A row alone, or at another place in another tile, sums the same.
    assert rows_equal(matmul_fixed_split(x[37:38].clone(), w, b, splits=3, schedule=schedule), ref[37:38])


def test_fixed_split_schedules_agree_and_counters_reset():
    """Both schedules on fp16 (exact) inputs without bias, several calls in a row: the tile
    counters the "programs" schedule leaves behind must be zero, or the next call's sums would
    be done early, by the wrong program, from partials not yet written."""
    x, w = exact_values(70, 96), exact_values(40, 96)
    first = matmul_fixed_split(x, w, splits=2, schedule="programs")
    assert torch.equal(first, matmul_ref(x, w))
    for m in (1, 70, 5):
        assert rows_equal(matmul_fixed_split(x[:m].clone(), w, splits=2, schedule="programs"), first[:m])
        assert rows_equal(matmul_fixed_split(x[:m].clone(), w, splits=2, schedule="loop"), first[:m])
    from rooflm.kernels.split_k import _COUNTERS
    assert int(_COUNTERS[x.device].abs().sum()) == 0


def test_split_plan_whole_k_steps_and_no_more_programs_than_needed(split_on):
    # H100 (132 SMs), Llama-3-8B, bf16 (BLOCK_N 64, BLOCK_K 64 compiled; the interpreter's tile
    # is 32 x 32, so these numbers are the compiled ones only on a GPU).
    block_n, block_k = matmul_config(torch.bfloat16, 1)[1:3]
    for n, k in [(4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096), (72, 200), (8, 64)]:
        splits, split_k = split_plan(n, k, torch.bfloat16, 132)
        assert split_k % block_k == 0 and cdiv_(k, split_k) == splits
        assert 1 <= splits <= 8 and (splits == 1 or cdiv_(n, block_n) * (splits - 1) < 132)
    assert split_plan(200_000, 4096, torch.bfloat16, 132) == (1, 4096)
    assert split_size(200, 3, 32) == 96  # 7 steps -> 3 + 3 + 1


def test_fixed_split_default_plan_and_checks(split_on):
    """Without an explicit S the plan splits these small weights on the interpreter's 4 'SMs'."""
    x, w, b = exact_values(9, 80), exact_values(72, 80), exact_values(72)
    assert split_plan(72, 80, torch.float16, 4)[0] > 1
    out = matmul_fixed_split(x, w, b)
    assert torch.equal(out, matmul_ref(x, w, b))
    assert rows_equal(matmul_fixed_split(x[4:5].clone(), w, b), out[4:5])
    with pytest.raises(ValueError, match="schedule"):
        matmul_fixed_split(x, w, schedule="stream-k")
    with pytest.raises(ValueError, match="BLOCK_K"):
        cfg = matmul_config(torch.float16, 1)
        matmul_fixed_split(x, w, splits=2, config=cfg[:2] + (cfg[2] * 2,) + cfg[3:])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (6144, 4096)])
def test_fixed_split_gpu_bf16_rows_invariant(n, k, split_on):
    """The Llama-3-8B projections that split on the H100 (o, down, qkv), bf16: both schedules,
    rows alone and inside M = 3, 64, 200, 2048 give the same bits, near the fp32 product."""
    torch.manual_seed(0)
    x = torch.randn(2048, k, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    splits, _ = split_plan(n, k, torch.bfloat16, torch.cuda.get_device_properties(0).multi_processor_count)
    assert splits > 1, "this GPU does not split the shape: the test would check nothing"
    full = matmul_fixed_split(x, w, schedule="loop")
    assert_close(full, matmul_ref(x, w), torch.bfloat16, "fixed split")
    programs = matmul_fixed_split(x, w, schedule="programs")
    assert rows_equal(programs, full), "schedules differ at M = 2048"
    for m in (1, 3, 64, 200):
        for schedule in ("programs", "loop"):
            assert rows_equal(matmul_fixed_split(x[:m].clone(), w, schedule=schedule), full[:m]), (m, schedule)
    assert rows_equal(matmul_fixed_split(x[1000:1001].clone(), w), full[1000:1001])


# Compiled for the H100 (sm_90) on a machine without one: Triton's NVIDIA backend and ptxas run
# offline, so the CPU suite sees whether the kernels build, keep the persistent matmul's software
# pipeline (shared memory = stages x tile bytes: the nested split loop must not lose it), and
# order the "programs" schedule's partials before its counter (barrier, acq_rel atomic, .cg
# reads). A subprocess: this process's kernels are the interpreter's, not compilable ones.
_SM90_COMPILE = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas
from rooflm.kernels.matmul_fixed_split import _split_loop_kernel, _split_programs_kernel, loop_config
from rooflm.kernels.matmul_persistent import MATMUL_BUCKETS, _matmul_persistent_kernel
import torch

def spills(ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\\d+) bytes spill stores", out))

def build(fn, args, config):
    block_m, block_n, block_k, group_m, warps, stages = config
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, HAS_BIAS=True,
                  DOT_PRECISION="tf32", UPCAST=False, PDL=False)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = dict(args, **{k: "constexpr" for k in consts})
    names = list(sig)
    # What a launch specialises on: 16-byte aligned pointers, sizes and strides divisible by 16 (not M).
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in args.items() if n != "M" and t != "constexpr"}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    return kernel.metadata.shared, kernel.asm["ptx"]

io = {"y_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
strides = {"stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
for m in (64, 2048):
    config = loop_config(torch.bfloat16, m)
    base, _ = build(_matmul_persistent_kernel, dict(io, num_programs="i32", **strides), config)
    loop, ptx = build(_split_loop_kernel, dict(io, SPLIT_K="i32", num_programs="i32", **strides), config)
    print("loop", config, base, loop)
    assert loop == base, f"split loop shared memory {loop} != persistent {base} at {config}"
    assert spills(ptx) == 0, f"split loop spills registers at {config}"
config = MATMUL_BUCKETS[torch.bfloat16][0][1]
base, _ = build(_matmul_persistent_kernel, dict(io, num_programs="i32", **strides), config)
programs_args = {"y_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32", "x_ptr": "*bf16", "w_ptr": "*bf16",
                 "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "SPLIT_K": "i32", "num_splits": "i32"}
shared, ptx = build(_split_programs_kernel, dict(programs_args, **strides), config)
print("programs", config, base, shared)
assert shared == base, f"programs shared memory {shared} != persistent {base}"
assert spills(ptx) == 0, "programs kernel spills registers"
from rooflm.kernels.matmul_persistent import BATCH1_CONFIGS
config = BATCH1_CONFIGS[torch.bfloat16]  # the batch-1 tile: it builds, without spills
_, batch1_ptx = build(_matmul_persistent_kernel, dict(io, num_programs="i32", **strides), config)
assert spills(batch1_ptx) == 0, f"batch-1 tile {config} spills registers"
atomic = ptx.index("atom.global.gpu.acq_rel.add")
assert "bar.sync" in ptx[ptx.rindex("st.global", 0, atomic):atomic], "no barrier between the partials and the counter"
assert "ld.global.cg" in ptx[atomic:], "partials not read through L2"
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in: on a GPU the kernels run")
def test_fixed_split_kernels_compile_for_sm90_with_the_persistent_pipeline():
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]


# ---- RMSNorm ------------------------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_row_is_the_same_for_every_row_count(with_residual):
    x = torch.randn(33, 300, device=DEVICE).half()
    r = torch.randn(33, 300, device=DEVICE).half() if with_residual else None
    w = torch.randn(300, device=DEVICE).half()
    full = rmsnorm(x, w, 1e-6, r)
    for lo, hi in [(0, 1), (32, 33), (5, 17)]:
        part = rmsnorm(x[lo:hi], w, 1e-6, None if r is None else r[lo:hi])
        if with_residual:  # (no dot here: random values, exact comparison)
            assert rows_equal(part[0], full[0][lo:hi]) and rows_equal(part[1], full[1][lo:hi])
        else:
            assert rows_equal(part, full[lo:hi])


# ---- attention: a token as a decode, in a chunk, beside others ----------------------------

def sub_meta(meta: AttentionMetadata, seqs: list[int], query_lens: list[int]) -> AttentionMetadata:
    """Metadata for the last query_lens[i] tokens of sequences seqs[i] of a full-prefill meta."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    seq_lens = [meta.seq_lens_cpu[s] for s in seqs]
    dev = meta.seq_lens.device
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=meta.block_tables[seqs].contiguous(), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_decodes=sum(1 for q in query_lens if q == 1),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)


def query_rows(meta: AttentionMetadata, q: torch.Tensor, seqs: list[int], query_lens: list[int]) -> torch.Tensor:
    starts = meta.query_start_loc_cpu
    return torch.cat([q[starts[s + 1] - n:starts[s + 1]] for s, n in zip(seqs, query_lens)])


def exact_attention_batch(seed: int, seq_lens: list[int], group: int = 2, num_kv_heads: int = 2,
                          head_dim: int = 64):
    """A full prefill of seq_lens in fp16 whose dots are exact (see exact_values): q.k in
    multiples of 1/4 up to 16; the softmax weights, fp16 in [2^-6, 1], times V in {-1, 0, 1}
    summed over <= 70 keys fit fp32's 24 bits. Returns (meta, k_cache, v_cache, q)."""
    torch.manual_seed(seed)
    meta, k_cache, v_cache = random_paged_batch(seq_lens, seq_lens, num_kv_heads, head_dim, 16, torch.float16,
                                                DEVICE)
    k_cache = torch.where(k_cache.isnan(), k_cache, exact_values(*k_cache.shape))
    v_cache = torch.where(v_cache.isnan(), v_cache, exact_values(*v_cache.shape, scale=1.0))
    return meta, k_cache, v_cache, exact_values(sum(seq_lens), num_kv_heads * group, head_dim)


@pytest.mark.parametrize("window", [None, 24])
def test_uniform_attention_row_same_as_decode_chunk_or_in_batch(window):
    meta, k_cache, v_cache, q = exact_attention_batch(21, [70, 45, 9])
    dtype, scale = torch.float16, 64 ** -0.5
    full = prefill_attention(q, k_cache, v_cache, meta, scale, window, uniform=True)
    assert_close(full, prefill_attention_ref(q, k_cache, v_cache, meta, scale, window), dtype, "uniform")
    # (sequences, query lengths): a decode alone, decodes beside a chunk, chunks of other sizes
    # and offsets, each sequence's last tokens taken from the full prefill above.
    for seqs, query_lens in [([0], [1]), ([1, 0, 2], [1, 1, 5]), ([0], [23]), ([2, 0], [1, 40]),
                             ([1], [45])]:
        sub = sub_meta(meta, seqs, query_lens)
        q_sub = query_rows(meta, q, seqs, query_lens)
        out = prefill_attention(q_sub, k_cache, v_cache, sub, scale, window, uniform=True)
        assert rows_equal(out, query_rows(meta, full, seqs, query_lens)), f"{seqs=} {query_lens=}"


def test_deterministic_backend_runs_decodes_in_short_uniform_tiles():
    """--deterministic: the decodes get a uniform launch of their own (fewer query rows per tile,
    the same key tiles), the chunks another, and the rows are the full prefill's."""
    meta, k_cache, v_cache, q = exact_attention_batch(5, [70, 45, 9])
    dtype, head_dim, group, scale = torch.float16, 64, 2, 64 ** -0.5
    full = prefill_attention(q, k_cache, v_cache, meta, scale, uniform=True)
    seqs, query_lens = [1, 0, 2], [1, 1, 5]
    sub = sub_meta(meta, seqs, query_lens)
    backend = TritonBackend(deterministic=True)
    q_sub = query_rows(meta, q, seqs, query_lens)
    decode, prefill = backend.plan(q_sub, k_cache, v_cache, sub, None, torch.empty_like(q_sub))
    assert isinstance(decode, PrefillPlan) and decode.uniform and prefill.uniform
    assert (decode.first_seq, decode.end_seq, prefill.first_seq) == (0, 2, 2)
    table = prefill_config(head_dim, group, dtype, tma=False)
    assert decode.config == uniform_decode_config(table, group) and decode.config[1:] == prefill.config[1:]
    assert uniform_decode_config((128, 64, 4, 3), 4) == (64, 64, 4, 3)
    out = backend.attend(q_sub, k_cache, v_cache, sub, scale, None)
    assert rows_equal(out, query_rows(meta, full, seqs, query_lens))


@pytest.mark.gpu
def test_uniform_attention_gpu_bf16_decode_equals_prefill_row():
    """Llama-3-8B attention shape (32 heads, 8 KV heads, D 128) in bf16, block size 16; the
    deterministic backend runs decodes in 64-row tiles and chunks in the table's 128."""
    torch.manual_seed(0)
    seq_lens = [900, 300, 1200]
    meta, k_cache, v_cache = random_paged_batch(seq_lens, seq_lens, 8, 128, 16, torch.bfloat16, DEVICE)
    q = torch.randn(sum(seq_lens), 32, 128, device=DEVICE).to(torch.bfloat16)
    full = prefill_attention(q, k_cache, v_cache, meta, 128 ** -0.5, uniform=True)
    backend = TritonBackend(deterministic=True)
    for seqs, query_lens in [([0], [1]), ([1, 0, 2], [1, 1, 256]), ([2], [700]), ([0, 1], [1, 300]),
                             ([2, 1, 0], [1, 1, 1])]:
        sub = sub_meta(meta, seqs, query_lens)
        q_sub = query_rows(meta, q, seqs, query_lens)
        out = prefill_attention(q_sub, k_cache, v_cache, sub, 128 ** -0.5, uniform=True)
        assert rows_equal(out, query_rows(meta, full, seqs, query_lens)), f"{seqs=} {query_lens=}"
        out = backend.attend(q_sub, k_cache, v_cache, sub, 128 ** -0.5, None)
        assert rows_equal(out, query_rows(meta, full, seqs, query_lens)), f"backend {seqs=} {query_lens=}"


# ---- the engine with --deterministic on the Triton path -------------------------------------

def test_engine_deterministic_triton_path_matches_reference(tmp_path, split_on):
    """The batch-invariant kernel set in the engine (persistent matmul in every linear layer and
    the LM head, decodes through the uniform prefill kernel, no GEMV) gives the reference's
    greedy tokens. Batch invariance itself is the GPU tests' (interpreter dots: see above)."""
    from rooflm import LLM, SamplingParams
    from tests.models.tiny_models import make_tiny_model

    path, _ = make_tiny_model(tmp_path, "qwen3", initializer_range=0.3)
    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 9]]  # 9 tokens, chunks of 8: a chunked prefill
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kw = dict(model=path, device=DEVICE, dtype="float32", block_size=4, max_num_batched_tokens=8,
              enforce_eager=True)
    ref = LLM(attention_backend="reference", **kw).generate(prompts, params)
    llm = LLM(attention_backend="triton", deterministic=True, **kw)
    model = llm.engine.runner.model
    assert llm.engine.runner.backend.deterministic and model.model.layers[0].gemv is None
    assert model.model.layers[0].mlp.down_proj.kernel is not None and model.linear is not None
    assert model.model.layers[0].self_attn.q_norm.kernel is not None  # head norms through Triton
    # The linears take the fixed-split order, and the tiny o_proj (one column tile) does split K.
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    assert split_plan(*o_proj.shape, o_proj.dtype, num_sms())[0] > 1, tuple(o_proj.shape)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
