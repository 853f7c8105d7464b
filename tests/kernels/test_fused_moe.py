"""The fused MoE (rooflm/kernels/fused_moe.py) against its fp32 definition, and moe_align_block_size
(rooflm/kernels/moe_align.py) against its one-pair-at-a-time construction, id for id."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_close
from rooflm.kernels.fused_moe import (FusedMoeConfig, GemmTile, default_config, expected_active_experts,
                                      fused_moe, fused_moe_bytes, fused_moe_ref, lookup_tuned)
from rooflm.kernels.moe_align import max_padded_rows, moe_align_block_size, moe_align_block_size_ref

TINY = FusedMoeConfig(16, GemmTile(32, 32), GemmTile(32, 32))


def random_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator,
                   experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token drawn from the first `experts` (default all): fewer makes the
    rest empty and the chosen ones crowded."""
    pool = experts or num_experts
    ids = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return weights.to(DEVICE), ids.to(DEVICE)


# ---- moe_align_block_size -------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (1, 8, 2, 16), (5, 4, 2, 4), (20, 8, 2, 16), (13, 6, 3, 4), (9, 16, 1, 8), (7, 5, 5, 2)])
def test_align_matches_the_definition(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    _, ids = random_routing(num_tokens, num_experts, top_k, gen)
    got = moe_align_block_size(ids, block_m, num_experts)
    want = moe_align_block_size_ref(ids.cpu(), block_m, num_experts)
    for name, g, w in zip(got._fields, got, want):
        assert g.dtype == torch.int32, name
        assert torch.equal(g.cpu(), w), f"{name}: {g.tolist()} != {w.tolist()}"


def test_align_pads_each_expert_and_skips_empty_ones():
    # experts 0 and 2 have tokens, 1 and 3 none: pairs are (token, k) flattened, p = 2 t + k
    ids = torch.tensor([[2, 0], [2, 0], [0, 2]])
    got = moe_align_block_size(ids, block_m=4, num_experts=4)
    pad = 6  # T * top_k
    assert got.sorted_token_ids.tolist()[:8] == [1, 3, 4, pad, 0, 2, 5, pad]
    assert got.sorted_token_ids.numel() == max_padded_rows(6, 4, 4) == 20  # 6 + 4 * 3, in whole blocks
    assert got.sorted_token_ids.tolist()[8:] == [pad] * 12
    assert got.expert_ids.tolist() == [0, 2, -1, -1, -1]
    assert got.num_tokens_post_padded.tolist() == [8]


def test_align_one_crowded_expert_spans_several_blocks():
    ids = torch.tensor([[3], [3], [3], [3], [3], [1]])
    got = moe_align_block_size(ids, block_m=2, num_experts=4)
    assert got.sorted_token_ids.tolist()[:8] == [5, 6, 0, 1, 2, 3, 4, 6]
    assert got.expert_ids.tolist()[:4] == [1, 3, 3, 3]
    assert got.num_tokens_post_padded.item() == 8


def test_align_array_sizes_depend_on_shapes_only():
    """CUDA graphs replay one launch grid for every routing of a batch size."""
    gen = torch.Generator().manual_seed(0)
    sizes = set()
    for crowd in (1, 2, 8):
        _, ids = random_routing(6, 8, 1, gen, experts=crowd)
        aligned = moe_align_block_size(ids, 4, 8)
        sizes.add((aligned.sorted_token_ids.numel(), aligned.expert_ids.numel()))
    assert len(sizes) == 1


def test_align_rejects_bad_inputs():
    with pytest.raises(ValueError, match="topk_ids must be"):
        moe_align_block_size(torch.zeros(4, dtype=torch.int64), 16, 4)
    with pytest.raises(TypeError, match="integer"):
        moe_align_block_size(torch.zeros(4, 2), 16, 4)


# ---- the fused kernel -----------------------------------------------------------------------

def make_layer(num_experts, hidden, inter, dtype, gen, bias=False):
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(DEVICE, dtype)
    if not bias:
        return w13, w2, None, None
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(DEVICE, dtype)
    b2 = torch.randn(num_experts, hidden, generator=gen).to(DEVICE, dtype)
    return w13, w2, b13, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,crowd", [
    (1, 8, 2, 32, 32, None),    # decode: two experts of eight
    (20, 4, 2, 64, 48, None),   # every expert, several blocks each; I not a tile multiple
    (11, 8, 2, 48, 64, 3),      # all tokens on three experts (uneven), five empty; H not a tile multiple
    (3, 6, 1, 32, 64, None),
])
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, hidden, inter, crowd, dtype):
    gen = torch.Generator().manual_seed(num_tokens + 7 * num_experts)
    w13, w2, _, _ = make_layer(num_experts, hidden, inter, dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = random_routing(num_tokens, num_experts, top_k, gen, experts=crowd)
    out = fused_moe(x, w13, w2, weights, ids, config=TINY)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_gpt_oss_activation_and_biases(dtype):
    gen = torch.Generator().manual_seed(3)
    w13, w2, b13, b2 = make_layer(8, 32, 32, dtype, gen, bias=True)
    # large gate/up values so the clamps at +-limit engage
    x = (4 * torch.randn(9, 32, generator=gen)).to(DEVICE, dtype)
    weights, ids = random_routing(9, 8, 2, gen)
    weights = torch.softmax(weights, dim=-1)
    kw = dict(b13=b13, b2=b2, activation="swigluoai", alpha=1.702, limit=7.0)
    out = fused_moe(x, w13, w2, weights, ids, config=TINY, **kw)
    ref = fused_moe_ref(x, w13, w2, weights, ids, **kw)
    assert (ref.abs() > 0).any()
    assert_close(out, ref, dtype)


def test_fused_moe_default_config_and_larger_blocks():
    """The heuristic's tiles (BLOCK_K 128 over H 64: masked K) and BLOCK_M 32 with GROUP_M 8."""
    gen = torch.Generator().manual_seed(5)
    w13, w2, _, _ = make_layer(4, 64, 32, torch.float32, gen)
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    weights, ids = random_routing(5, 4, 2, gen)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert_close(fused_moe(x, w13, w2, weights, ids), ref, torch.float32, "default config")
    grouped = FusedMoeConfig(32, GemmTile(16, 16, 8), GemmTile(32, 32, 8))
    assert_close(fused_moe(x, w13, w2, weights, ids, config=grouped), ref, torch.float32, "BLOCK_M 32")


def test_fused_moe_rejects_mismatched_shapes():
    x = torch.randn(2, 32, device=DEVICE)
    w13 = torch.randn(4, 64, 32, device=DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(x, w13, torch.randn(4, 32, 16, device=DEVICE), torch.ones(2, 2, device=DEVICE), ids)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, torch.randn(4, 32, 32, device=DEVICE), torch.ones(2, 2, device=DEVICE), ids,
                  activation="gelu")


# ---- configs and counting --------------------------------------------------------------------

def test_default_config_grows_blocks_with_tokens_per_expert():
    decode = default_config(1, 128, 8, 2048, 768)
    prefill = default_config(8192, 128, 8, 2048, 768)
    assert decode.block_m == 16 and prefill.block_m == 128
    # batch 1, 8 experts: narrow column blocks so the weight reads reach every SM
    assert decode.gate_up.block_n == 32


def test_tuned_table_wins_and_takes_the_next_batch_up():
    cfg = FusedMoeConfig(32, GemmTile(64, 64, 4, 4, 3), GemmTile(128, 64, 4, 8, 3))
    entry = dict(e=8, top_k=2, h=4096, i=14336, config=cfg.to_dict())
    table = {"GPU X": {"fused_moe": [dict(entry, m=16), dict(entry, m=64, config=TINY.to_dict())]}}
    assert lookup_tuned("GPU X", 8, 2, 4096, 14336, 9, table) == cfg
    assert lookup_tuned("GPU X", 8, 2, 4096, 14336, 1000, table) == TINY
    assert lookup_tuned("GPU X", 8, 2, 4096, 1024, 9, table) is None
    assert lookup_tuned(None, 8, 2, 4096, 14336, 9, table) is None


def test_batch_one_reads_only_the_chosen_experts():
    assert expected_active_experts(1, 128, 8) == pytest.approx(8)
    assert 125 < expected_active_experts(64, 128, 8) < 127
    one = fused_moe_bytes(1, 8, 8, 2048, 768, 2)
    all_experts = 128 * 3 * 2048 * 768 * 2
    assert 8 * 3 * 2048 * 768 * 2 < one < all_experts / 15


# ---- GPU: compiled, bf16, shapes of real models ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64, 256, 1024])
@pytest.mark.parametrize("num_experts,top_k,hidden,inter", [(128, 8, 2048, 768), (8, 2, 1024, 3584), (32, 4, 512, 256)])
def test_fused_moe_gpu_bf16(num_tokens, num_experts, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(num_tokens)
    w13, w2, _, _ = make_layer(num_experts, hidden, inter, torch.bfloat16, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = random_routing(num_tokens, num_experts, top_k, gen)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids), torch.bfloat16)


@pytest.mark.gpu
def test_fused_moe_gpu_gpt_oss_bf16():
    gen = torch.Generator().manual_seed(1)
    w13, w2, b13, b2 = make_layer(32, 2880, 2880, torch.bfloat16, gen, bias=True)
    x = (3 * torch.randn(37, 2880, generator=gen)).to(DEVICE, torch.bfloat16)
    weights, ids = random_routing(37, 32, 4, gen)
    kw = dict(b13=b13, b2=b2, activation="swigluoai")
    assert_close(fused_moe(x, w13, w2, weights, ids, **kw), fused_moe_ref(x, w13, w2, weights, ids, **kw),
                 torch.bfloat16)


@pytest.mark.gpu
def test_fused_moe_gpu_replays_in_a_cuda_graph_with_new_routing():
    """No host sync in align or the launches: a captured call follows the routing of each replay."""
    gen = torch.Generator().manual_seed(2)
    w13, w2, _, _ = make_layer(16, 256, 128, torch.bfloat16, gen)
    x = torch.randn(8, 256, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = random_routing(8, 16, 2, gen)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for crowd in (None, 2):
        new_w, new_ids = random_routing(8, 16, 2, gen, experts=crowd)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), torch.bfloat16, f"crowd {crowd}")


# ---- the MoE block's fused path (layers/moe.py wiring) ---------------------------------------

@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_moe_block_fused_path_matches_its_torch_path(activation):
    """The kernel as Kernels.fused_moe inside SparseMoeBlock: same weights, same routing, the
    block's torch experts loop as the reference (biases and a shared expert included)."""
    from rooflm.layers.kernels import Kernels
    from rooflm.layers.moe import MoeConfig, SparseMoeBlock
    gpt_oss = activation == "swigluoai"
    cfg = MoeConfig(num_experts=6, top_k=2, hidden_size=32, intermediate_size=32, activation=activation,
                    scoring="softmax_topk" if gpt_oss else "softmax", router_bias=gpt_oss, expert_bias=gpt_oss,
                    shared_expert_intermediate_size=0 if gpt_oss else 32)
    gen = torch.Generator().manual_seed(4)
    torch_block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in torch_block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    fused_block = SparseMoeBlock(cfg, kernels=Kernels(fused_moe=fused_moe))
    fused_block.load_state_dict(torch_block.state_dict())
    torch_block.to(DEVICE)
    fused_block.to(DEVICE)
    x = torch.randn(10, 32, generator=gen).to(DEVICE)
    with torch.no_grad():
        assert_close(fused_block(x), torch_block(x), torch.float32)


def test_a_block_of_an_expert_held_elsewhere_writes_zeros():
    """expert_ids -1 (expert parallelism's hook): that block's rows come out zero, the rest as usual."""
    from rooflm.kernels.fused_moe import _launch
    gen = torch.Generator().manual_seed(6)
    w13, w2, _, _ = make_layer(4, 32, 32, torch.float32, gen)
    x = torch.randn(6, 32, generator=gen).to(DEVICE)
    weights, ids = random_routing(6, 4, 2, gen)
    aligned = moe_align_block_size(ids, 16, 4)
    remote = int(aligned.expert_ids[0])
    aligned.expert_ids[0] = -1
    h = torch.full((12, 32), float("nan"), device=DEVICE)
    _launch(h, x, w13, None, weights.reshape(-1), aligned, 12, 2, "silu", False, 16, GemmTile(32, 32), 1.702, 7.0)
    on_remote = (ids.reshape(-1) == remote).to(DEVICE)
    assert on_remote.any() and (~on_remote).any()
    assert torch.equal(h[on_remote], torch.zeros_like(h[on_remote]))
    gate_up = torch.einsum("th,tkih->tki", x, w13[ids]).reshape(12, 64)
    want = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    assert_close(h[~on_remote], want[~on_remote], torch.float32)


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_expert_parallel_halves_sum_to_the_whole_layer(num_tokens):
    """local_only: each of two ranks runs only the pairs of its own half of the experts (the
    others' ids -1), rows of the rest zero; the two outputs add up to the one-rank layer."""
    from rooflm.layers.moe import local_expert_ids
    gen = torch.Generator().manual_seed(num_tokens)
    w13, w2, b13, b2 = make_layer(8, 32, 32, torch.float32, gen, bias=True)
    x = torch.randn(num_tokens, 32, generator=gen).to(DEVICE)
    weights, ids = random_routing(num_tokens, 8, 3, gen)
    parts = [fused_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, local_expert_ids(ids, r * 4, 4),
                       b13=b13[r * 4:(r + 1) * 4], b2=b2[r * 4:(r + 1) * 4], config=TINY, local_only=True)
             for r in range(2)]
    want = fused_moe_ref(x, w13, w2, weights, ids, b13=b13, b2=b2)
    assert_close(parts[0] + parts[1], want, torch.float32)
