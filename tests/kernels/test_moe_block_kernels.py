"""SparseMoeBlock's CUDA path (rooflm/layers/moe.py with Kernels.moe_router, moe_align and
fused_moe) against its torch path, the launches a batch-1 layer makes, and FP8 experts through
the block. On the CPU the Triton kernels run under the interpreter, in fp32."""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernels.helpers import DEVICE, rel_error
from rooflm.kernels.fused_moe import fused_moe
from rooflm.kernels.moe_align import moe_align_block_size_triton
from rooflm.kernels.moe_router import moe_router
from rooflm.layers.kernels import Kernels
from rooflm.layers.moe import MoeConfig, SparseMoeBlock

TRITON_MOE = Kernels(fused_moe=fused_moe, moe_router=moe_router, moe_align=moe_align_block_size_triton)

QWEN3 = MoeConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=32, norm_topk_prob=True)
GPT_OSS = MoeConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=32, scoring="softmax_topk",
                    router_bias=True, expert_bias=True, activation="swigluoai", gate_up_interleaved=True)


def _block(cfg: MoeConfig, kernels: Kernels = Kernels(), seed: int = 0) -> SparseMoeBlock:
    block = SparseMoeBlock(cfg, kernels)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return block.to(DEVICE)


def _twins(cfg: MoeConfig):
    """The same weights in a torch block and a Triton one."""
    return _block(cfg), _block(cfg, TRITON_MOE)


# ---- launch counting -------------------------------------------------------------------------

# aten ops that launch nothing: views, allocations, metadata
FREE = {"view", "_unsafe_view", "t", "transpose", "reshape", "empty", "empty_strided", "detach", "alias",
        "as_strided", "expand", "unsqueeze", "squeeze", "slice", "select", "lift_fresh"}


class LaunchCounter(TorchDispatchMode):
    """Records the aten ops that run kernels (not views or allocations) and, by patching the
    Triton launcher, each Triton kernel launched; torch's own work inside a launch (the
    interpreter's copies) is not counted."""

    def __init__(self):
        super().__init__()
        self.aten: list[str] = []
        self.triton: list[str] = []
        self.inside_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_triton and name not in FREE:
            self.aten.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counter(monkeypatch):
    counting = LaunchCounter()
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction as launcher
    else:
        from triton.runtime.jit import JITFunction as launcher
    real_run = launcher.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            counting.triton.append(self.fn.__name__)
        counting.inside_triton = True
        try:
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counting.inside_triton = False

    monkeypatch.setattr(launcher, "run", run)
    return counting


@pytest.mark.parametrize("cfg,matmul", [(QWEN3, {"mm"}), (GPT_OSS, {"addmm"})])
def test_batch_one_moe_layer_is_the_router_matmul_and_five_launches(cfg, matmul, counter):
    """Router matmul + router + align + gate_up GEMM + down GEMM + the sum over k."""
    block = _block(cfg, TRITON_MOE)
    x = torch.randn(1, cfg.hidden_size, device=DEVICE)
    with torch.no_grad(), counter:
        block(x)
    assert counter.triton == ["_router_kernel", "_moe_align_kernel", "_fused_moe_kernel", "_fused_moe_kernel"]
    assert len(counter.aten) == 2 and set(counter.aten[:1]) == matmul and counter.aten[1] == "sum", counter.aten


def test_the_torch_path_makes_many_more_launches(counter):
    """The count above means something: the same block on torch's path launches far more."""
    block = _block(QWEN3)
    with torch.no_grad(), counter:
        block(torch.randn(1, QWEN3.hidden_size, device=DEVICE))
    assert counter.triton == [] and len(counter.aten) > 10


# ---- the Triton block against the torch block -------------------------------------------------

@pytest.mark.parametrize("cfg", [QWEN3, GPT_OSS], ids=["qwen3", "gpt-oss"])
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_triton_block_matches_the_torch_block(cfg, num_tokens):
    ref, fused = _twins(cfg)
    x = torch.randn(num_tokens, cfg.hidden_size, device=DEVICE)
    with torch.no_grad():
        want_w, want_ids = ref.router(x)
        got_w, got_ids = fused.router(x)
        assert torch.equal(got_ids.long(), want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=2e-7)
        assert rel_error(fused(x), ref(x)) < 1e-4


# ---- FP8 experts through the block ------------------------------------------------------------

@pytest.mark.parametrize("cfg", [QWEN3, GPT_OSS], ids=["qwen3", "gpt-oss"])
def test_fp8_experts_block_torch_and_triton_agree(cfg):
    ref, fused = _twins(cfg)
    x = torch.randn(5, cfg.hidden_size, device=DEVICE)
    with torch.no_grad():
        want_float = ref(x)
        for block in (ref, fused):
            block.experts.quantize_fp8()
        assert fused.experts.w13.dtype == torch.float8_e4m3fn and fused.experts.quant_format == "fp8"
        torch_fp8, triton_fp8 = ref(x), fused(x)
    assert rel_error(triton_fp8, torch_fp8) < 2e-3  # the same W8A8 sums, in another order
    assert 1e-4 < rel_error(torch_fp8, want_float) < 0.08  # the format's error, not a bug's


def test_fp8_experts_store_one_byte_a_weight_plus_scales():
    block = _block(QWEN3)
    experts = block.experts
    count = experts.weight_count()
    assert experts.stored_weight_bytes() == 4 * count
    experts.quantize_fp8()
    e, h, i = QWEN3.num_experts, QWEN3.hidden_size, QWEN3.intermediate_size
    assert experts.weight_count() == count == e * 3 * h * i
    assert experts.stored_weight_bytes() == count + 4 * e * (2 * i + h)
    stored = sum(t.numel() * t.element_size() for t in list(experts.parameters()) + list(experts.buffers()))
    assert stored == experts.stored_weight_bytes()  # what the runner's weight_bytes() sums

