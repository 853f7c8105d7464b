"""The device loop's prepare/accept kernels (rooflm/kernels/spec_loop_step.py) against the loop's
torch path (SpecLoop._prepare_torch / _accept_torch), on random states."""

import types

import pytest
import torch

from tests.kernels.helpers import DEVICE
from rooflm.kernels.spec_loop_step import accept_step, prepare_step
from rooflm.spec.loop import SpecLoop

BUFFERS = ("hist", "lengths", "limit", "active", "live", "drafts", "num_drafts", "block_tables",
           "input_ids", "positions", "slot_mapping", "seq_lens", "pack")


def random_loop(device, seed, k=4, slots=16, max_model_len=96, block_size=16):
    g = torch.Generator().manual_seed(seed)
    runner = types.SimpleNamespace(block_size=block_size, device=torch.device(device))
    loop = SpecLoop(runner, k, max_tokens=slots * (k + 1), max_seqs=slots, max_model_len=max_model_len)
    n = loop.max_batch
    loop.hist.copy_(torch.randint(0, 5, (n, max_model_len), generator=g, dtype=torch.int32))
    lengths = torch.randint(1, max_model_len - 2 * (k + 1), (n,), generator=g)
    loop.lengths.copy_(lengths)
    loop.limit.copy_(lengths + torch.randint(0, 2 * k, (n,), generator=g))  # some at or near it
    loop.active.copy_(torch.rand(n, generator=g) < 0.8)
    loop.drafts.copy_(torch.randint(0, 5, (n, k), generator=g))
    loop.num_drafts.copy_(torch.randint(0, k + 1, (n,), generator=g))
    loop.block_tables.copy_(torch.randint(0, 50, loop.block_tables.shape, generator=g, dtype=torch.int32))
    return loop


def state(loop):
    return {name: getattr(loop, name).clone().cpu() for name in BUFFERS}


@pytest.mark.parametrize("seed", range(4))
def test_prepare_and_accept_match_the_torch_path(seed):
    ref, got = random_loop("cpu", seed), random_loop(DEVICE, seed)
    b = ref.max_batch - 1  # the last slot is left alone
    ref._prepare_torch(b)
    prepare_step(got, b)
    assert state(ref).keys() == state(got).keys()
    for name, value in state(ref).items():
        assert torch.equal(value, state(got)[name]), name
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(b * ref.width, 5, generator=g)
    # Make most drafts agree with their rows' argmax, so runs of acceptances occur.
    for s in range(b):
        for j in range(ref.k):
            if torch.rand(1, generator=g) < 0.7:
                logits[s * ref.width + j, ref.drafts[s, j]] += 10.0
    target = logits.view(b, ref.width, -1).argmax(dim=-1)
    ref._accept_torch(b, target)
    accept_step(got, b, target.to(DEVICE))
    for name, value in state(ref).items():
        assert torch.equal(value, state(got)[name]), name
    counts = ref.pack[:b, ref.width]
    assert (counts > 1).any() and (counts == 0).any()  # acceptances happened; dead slots too


_SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rooflm.kernels.spec_loop_step import _accept_kernel, _prepare_kernel
for fn, sig, consts in (
        (_prepare_kernel, dict(hist_ptr="*i32", lengths_ptr="*i64", limit_ptr="*i64", active_ptr="*i1",
                               live_ptr="*i1", drafts_ptr="*i64", num_drafts_ptr="*i64", block_tables_ptr="*i32",
                               input_ids_ptr="*i64", positions_ptr="*i64", slots_ptr="*i64", seq_lens_ptr="*i32",
                               stride_h="i32", stride_bt="i32", max_blocks="i32"),
         dict(K=4, W=5, W_PAD=8, BLOCK_SIZE=64)),
        (_accept_kernel, dict(target_ptr="*i64", hist_ptr="*i32", lengths_ptr="*i64", live_ptr="*i1",
                              drafts_ptr="*i64", num_drafts_ptr="*i64", pack_ptr="*i64", stride_h="i32",
                              hist_len="i32"),
         dict(K=4, W=5, W_PAD=8))):
    triton.compile(ASTSource(fn, dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
print("ok")
"""


def test_kernels_compile_for_sm90():
    """Compiled for sm_90 offline (the interpreter accepts what the compiler may not)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
