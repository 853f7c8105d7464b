"""Batch-1 GEMV with fused norm / gate / residual (rooflm/kernels/gemv.py) against the unfused
layers, and its multi-row form (a few tokens: speculative verify forwards, small decode batches)."""

import itertools

import pytest
import torch
import triton

from tests.kernels.conftest import DEVICE, KERNEL_TESTS, assert_close, requires_cuda
from rooflm.kernels.gemv import (ROWS_PAD, GemvConfig, _gemv_rows_kernel, gemv, gemv_ref, gemv_rows,
                                 pick_rows_config)
from rooflm.kernels.utils import dot_precision, rel_error, upcast_dots


def _inputs(n, k, dtype, gated=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * n if gated else n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    return x, w, g


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(64, 128), (40, 96), (7, 300)])
def test_gemv_plain_matches_linear(n, k, dtype):
    x, w, _ = _inputs(n, k, dtype)
    assert_close(gemv(x, w), gemv_ref(x, w), dtype)


@pytest.mark.parametrize("n,k", [(64, 128), (36, 200)])
def test_gemv_fused_norm_gate_residual_bias(n, k):
    dtype = torch.float16
    x, w, g = _inputs(n, k, dtype, gated=True)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(1, n, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    assert_close(gemv(x, w, norm_weight=norm_w, eps=1e-5, gated=True),
                 gemv_ref(x, w, norm_weight=norm_w, eps=1e-5, gated=True), dtype, "norm+gated")
    plain_w = w[:n]
    assert_close(gemv(x, plain_w, residual=res), gemv_ref(x, plain_w, residual=res), dtype, "residual")
    assert_close(gemv(x, plain_w, bias=bias, norm_weight=norm_w),
                 gemv_ref(x, plain_w, bias=bias, norm_weight=norm_w), dtype, "norm+bias")


def test_gemv_out_dtype_and_inputs_untouched():
    x, w, g = _inputs(32, 64, torch.float16)
    res = torch.randn(1, 32, generator=g).to(torch.float16).to(DEVICE)
    x0, r0 = x.clone(), res.clone()
    out = gemv(x, w, residual=res, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (1, 32)
    assert torch.equal(x, x0) and torch.equal(res, r0)


def test_gemv_rejects_bad_shapes():
    x, w, _ = _inputs(16, 32, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        gemv(torch.randn(ROWS_PAD + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 32\]"):
        gemv(x, torch.randn(16, 31, device=DEVICE))
    with pytest.raises(ValueError, match="gated"):
        gemv(x, w[:15], gated=True)
    with pytest.raises(ValueError, match="residual must have 16"):
        gemv(x, w, residual=torch.randn(1, 8, device=DEVICE))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
                                       (4096, 14336, False), (128256, 4096, False), (1000, 1000, True)])
@pytest.mark.parametrize("config", [None, GemvConfig(16, 1024, 8, 3), GemvConfig(4, 256, 4, 1)])
def test_gemv_gpu_bf16_llama_shapes(n, k, gated, config):
    dtype = torch.bfloat16
    x, w, g = _inputs(n, k, dtype, gated=gated)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(1, n, generator=g).to(dtype).to(DEVICE)
    kwargs = dict(norm_weight=norm_w, eps=1e-5, gated=gated) if gated else dict(residual=res)
    assert_close(gemv(x, w, config=config, **kwargs), gemv_ref(x, w, **kwargs), dtype)


# ---- a few tokens: gemv_rows -------------------------------------------------------------------

# (norm, gated, residual, bias): every combination the kernel takes (gated has no bias).
FLAGS = [f for f in itertools.product((False, True), repeat=4) if not (f[1] and f[3])]


def _rows_inputs(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(m, n, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    return x, w, norm_w, res, bias


def _flag_kwargs(flags, n, norm_w, res, bias):
    norm, gated, residual, has_bias = flags
    return dict(norm_weight=norm_w if norm else None, eps=1e-5, gated=gated,
                residual=res if residual else None, bias=bias if has_bias else None)


def _close_to_layers(out, ref, dtype, what):
    """assert_close, but Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (compiled
    kernels: to nearest), and the norm and gated casts then drift up to 3.1e-2 from torch's
    (the batch-1 kernel's exactly as much): 5e-2 there. O(1) errors (a wrong row, stride or
    mask) still fail; test_gemv_rows_rows_are_the_batch1_gemvs checks bf16 tightly."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        err = rel_error(out, ref)
        assert err < 5e-2, f"{what} relative error {err:.3e} (bf16, interpreter)"
    else:
        assert_close(out, ref, dtype, what)


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_rows_matches_the_layers_for_every_flag(m, dtype):
    """n, k off the tiles (the interpreter's 16 x 32: 40 = 2.5 x 16, 100 = 3.125 x 32; compiled,
    less than one tile): masked edges in both dimensions."""
    n, k = 40, 100
    x, w, norm_w, res, bias = _rows_inputs(m, n, k, dtype, seed=m)
    for flags in FLAGS:
        kw = _flag_kwargs(flags, n, norm_w, res, bias)
        weight = w if flags[1] else w[:n]
        out = gemv_rows(x, weight, **kw)
        assert out.shape == (m, n) and out.dtype == dtype
        _close_to_layers(out, gemv_ref(x, weight, **kw), dtype, "norm={} gated={} res={} bias={}".format(*flags))
    # the LM head: fp32 logits
    out = gemv_rows(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, gemv_ref(x, w, out_dtype=torch.float32), dtype, "out fp32")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_rows_rows_are_the_batch1_gemvs(dtype):
    """Row i of a 5-token gemv_rows is the batch-1 kernel's gemv of token i (same casts; only
    the sum order differs), for every flag combination."""
    m, n, k = 5, 40, 96
    x, w, norm_w, res, bias = _rows_inputs(m, n, k, dtype, seed=11)
    for flags in FLAGS:
        kw = _flag_kwargs(flags, n, norm_w, res, bias)
        weight = w if flags[1] else w[:n]
        out = gemv_rows(x, weight, **kw)
        for i in range(m):
            one = dict(kw, residual=res[i:i + 1] if flags[2] else None)
            assert_close(out[i:i + 1], gemv(x[i:i + 1], weight, **one), dtype, "row {} of {}".format(i, flags))


@pytest.mark.parametrize("m", [2, 5, 8])
def test_gemv_takes_a_few_tokens_through_gemv_rows(m):
    x, w, norm_w, res, _ = _rows_inputs(m, 24, 64, torch.float32, seed=m)
    kw = dict(norm_weight=norm_w, gated=True)
    assert torch.equal(gemv(x, w, **kw), gemv_rows(x, w, **kw))
    assert torch.equal(gemv(x, w[:24], residual=res), gemv_rows(x, w[:24], residual=res))


def test_gemv_rows_row_is_its_own():
    """Each output row depends on its own token only (padding rows are zeros, never mixed in)."""
    x, w, norm_w, _, _ = _rows_inputs(6, 24, 64, torch.float32, seed=3)
    both = gemv_rows(x, w, norm_weight=norm_w, gated=True)
    assert_close(both[2:3], gemv_rows(x[2:3].clone(), w, norm_weight=norm_w, gated=True), torch.float32)
    with pytest.raises(ValueError, match="1 to 16 tokens"):
        gemv_rows(torch.randn(17, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="residual must have 144"):
        gemv_rows(x, w[:24], residual=torch.randn(1, 24, device=DEVICE))


@pytest.mark.parametrize("gated", [False, True])
def test_gemv_rows_strides_and_padding_rows(gated):
    """x and residual as row views of wider tensors (strides != K, != N) are read by their
    strides; an output of ROWS_PAD rows keeps rows M.. untouched (the padding is never stored)."""
    m, n, k, dtype = 5, 40, 96, torch.float16
    x, w, norm_w, res, _ = _rows_inputs(m, n, k, dtype, seed=7)
    x_wide = torch.zeros(m, k + 32, dtype=dtype, device=DEVICE)
    x_wide[:, 8:8 + k] = x
    res_wide = torch.zeros(m, n + 24, dtype=dtype, device=DEVICE)
    res_wide[:, :n] = res
    xv, rv = x_wide[:, 8:8 + k], res_wide[:, :n]
    weight = w if gated else w[:n]
    out = torch.full((ROWS_PAD, n + 8), float("nan"), dtype=dtype, device=DEVICE)
    cfg = pick_rows_config(n, k, gated, dtype)
    _gemv_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        out, xv, weight, xv, rv, norm_w, m, n, k, xv.stride(0), weight.stride(0), rv.stride(0),
        out.stride(0), 1e-5, ROWS=ROWS_PAD, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(dtype), UPCAST=upcast_dots(dtype), NORM=True, GATED=gated,
        HAS_BIAS=False, HAS_RESIDUAL=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ref = gemv_ref(x, weight, norm_weight=norm_w, eps=1e-5, gated=gated, residual=res)
    assert_close(out[:m, :n], ref, dtype)
    assert out[m:].isnan().all() and out[:, n:].isnan().all()
    assert torch.equal(gemv_rows(xv, weight, norm_weight=norm_w, eps=1e-5, gated=gated, residual=rv), out[:m, :n])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
                                       (4096, 14336, False), (128256, 4096, False)])
def test_gemv_rows_gpu_bf16_llama_shapes(m, n, k, gated):
    """The picked tiles on the 8B shapes, with the fusions the model uses on each."""
    dtype = torch.bfloat16
    x, w, norm_w, _, _ = _rows_inputs(m, n, k, dtype, seed=m)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    weight = w if gated else w[:n]
    if gated or n == 6144:
        kw = dict(norm_weight=norm_w, eps=1e-5, gated=gated)
    elif n == 128256:
        kw = dict(out_dtype=torch.float32)
    else:
        kw = dict(residual=res)
    assert_close(gemv(x, weight, **kw), gemv_ref(x, weight, **kw), dtype)


# Compiled for the H100 (sm_90) on a machine without one (Triton's NVIDIA backend and ptxas run
# offline, as tests/kernels/test_weight_only.py does): every tile pick_rows_config gives the
# Llama-3-8B shapes, under every (norm, gated, residual) combination, fits the H100's 227 KB of
# shared memory (the reverted gated path needed more: the launch failed), does not spill, and
# keeps its cp.async load pipeline. A subprocess: this process's kernels are the interpreter's
# when there is no GPU.
_SM90_ROWS = """
import itertools, re
import torch
from benchmarks.quant_gemv_sass import compile_kernel, cuobjdump
from rooflm.kernels import gemv as G

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # (N, K); gate_up's N per half
DIVISIBLE = ("N", "K", "stride_x", "stride_w", "stride_r", "stride_o")  # as the 8B shapes specialize
seen = set()
for (name, (n, k)), dtype, (norm, gated, residual) in itertools.product(
        SHAPES.items(), (torch.bfloat16, torch.float32), itertools.product((False, True), repeat=3)):
    c = G.pick_rows_config(n, k, gated, dtype)
    dt = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    out = "fp32" if name == "lm_head" else dt
    key = (c, dt, out, norm, gated, residual, name == "qkv")
    if key in seen:
        continue
    seen.add(key)
    kern = compile_kernel(
        G._gemv_rows_kernel, dict(out_ptr=out, x_ptr=dt, w_ptr=dt, bias_ptr=dt, residual_ptr=dt, norm_w_ptr=dt),
        dict(ROWS=G.ROWS_PAD, BLOCK_N=c.block_n, BLOCK_K=c.block_k, DOT_PRECISION="tf32x3" if dt == "fp32" else "tf32",
             UPCAST=False, NORM=norm, GATED=gated, HAS_BIAS=name == "qkv", HAS_RESIDUAL=residual, PDL=True),
        c.num_warps, c.num_stages, divisible=DIVISIBLE, scalar_types=dict(eps="fp32"))
    usage = re.search(r"REG:(\\d+) STACK:(\\d+) SHARED:\\d+ LOCAL:(\\d+)", cuobjdump(kern, "-res-usage"))
    what = f"{name} {dt} norm={norm} gated={gated} residual={residual} {c}"
    assert kern.metadata.shared <= 227 * 1024, (what, kern.metadata.shared)
    assert usage and usage.group(2) == "0" and usage.group(3) == "0", (what, "spills", usage and usage.groups())
    assert "cp.async" in kern.asm["ptx"], (what, "lost its load pipeline")
    print(what, kern.metadata.shared, "B shared,", usage.group(1), "registers")
print("ok")
"""


def test_rows_tiles_compile_for_sm90_in_shared_memory_without_spills():
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(KERNEL_TESTS))
    done = subprocess.run([sys.executable, "-c", _SM90_ROWS], env=dict(env, PYTHONPATH=root), cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
