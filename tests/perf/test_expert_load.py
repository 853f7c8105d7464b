"""MoE load imbalance: the device-side counter an MoE block adds its routing to (graph padding
rows left out), its summary (max/mean per step and over the pass, the hottest expert, per rank
under expert parallelism), and `rooflm profile` printing it for a tiny random Qwen3-MoE on CPU."""

import json
import os

import pytest
import torch

from rooflm.cli import main
from rooflm.engine.report import ExpertLoad
from rooflm.layers.moe import MoeConfig, SparseMoeBlock, attach_expert_load_counter
from rooflm.perf.profile import expert_load_summary, format_expert_load
from tests.models.test_moe_parity import make_tiny_moe


def _block(seed=0):
    cfg = MoeConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, norm_topk_prob=True)
    block = SparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return block


def _expected(block, x, real):
    _, ids = block.router(x[:real])
    return torch.bincount(ids.reshape(-1), minlength=block.cfg.num_experts)


def test_counter_counts_the_real_rows_of_each_step_only():
    block = _block()
    wrapper = torch.nn.Sequential(block)
    counter = attach_expert_load_counter(wrapper, "cpu", max_tokens=6)
    assert counter.names == ("0",) and block.load_counter is counter
    x1, x2, x3 = (torch.randn(n, 16, generator=torch.Generator().manual_seed(n)) for n in (6, 4, 9))
    block(x1)  # before any step (the memory profile, graph capture): nothing counts
    assert counter.counts.sum() == 0
    counter.begin_step(3)  # 3 real rows, 3 padding rows of a captured batch
    block(x1)
    counter.begin_step(4)
    block(x2)
    counter.begin_step(7)  # more rows than max_tokens: masked on the fly
    block(x3)
    recent = counter.recent(5)  # only 3 steps begun
    assert recent.shape == (3, 1, 4)
    for step, (x, real) in enumerate(((x1, 3), (x2, 4), (x3, 7))):
        assert torch.equal(recent[step, 0], _expected(block, x, real).to(torch.int32)), step
    assert recent[0].sum() == 3 * 2 and recent[2].sum() == 7 * 2


def test_counter_ring_keeps_the_last_steps():
    block = _block(1)
    counter = attach_expert_load_counter(torch.nn.Sequential(block), "cpu", max_tokens=4)
    counter.history = 2
    counter.counts = torch.zeros(1, 2, 4, dtype=torch.int32)
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    for x in xs:
        counter.begin_step(4)
        block(x)
    recent = counter.recent(3)
    assert recent.shape == (2, 1, 4)  # the ring holds two
    assert torch.equal(recent[0, 0], _expected(block, xs[1], 4).to(torch.int32))
    assert torch.equal(recent[1, 0], _expected(block, xs[2], 4).to(torch.int32))


def test_summary_imbalance_hottest_expert_and_ranks():
    # 2 layers x 4 experts, 2 steps; expert parallel over 2 ranks (experts 0-1, 2-3)
    counts = (((6, 2, 0, 0), (2, 2, 2, 2)),
              ((4, 0, 2, 2), (0, 0, 0, 0)))  # layer 1 routes nothing in step 2
    load = ExpertLoad(layers=("model.layers.0.mlp", "model.layers.1.mlp"), num_experts=4, top_k=2,
                      ep_ranks=2, steps_begun=9, counts=counts)
    s = expert_load_summary(load)
    first, second = s["layers"]
    assert first["routed"] == 16 and first["steps"] == 2
    # step 1: max 6 over mean 2 = 3x; step 2: 4 / 2 = 2x
    assert first["step_imbalance"] == pytest.approx(2.5)
    assert first["pass_imbalance"] == pytest.approx(10 / 4)  # totals (10, 2, 2, 2)
    assert first["hottest_expert"] == 0 and first["hottest_share"] == pytest.approx(10 / 16)
    assert first["experts_touched_per_step"] == pytest.approx(2.5)
    # ranks: step 1 (8, 0) -> 2x, step 2 (4, 4) -> 1x; pass (12, 4) -> 1.5x
    assert first["rank_step_imbalance"] == pytest.approx(1.5)
    assert first["rank_pass_imbalance"] == pytest.approx(1.5)
    assert first["rank_share"] == pytest.approx([0.75, 0.25])
    assert second["steps"] == 1 and second["step_imbalance"] == pytest.approx(1.0)
    assert s["routed"] == 24 and s["step_imbalance"] == pytest.approx(1.75)
    assert s["worst_layer"]["layer"] == "model.layers.0.mlp"
    assert s["hottest"] == {"layer": "model.layers.0.mlp", "expert": 0, "share": pytest.approx(10 / 16)}
    text = "\n".join(format_expert_load(s))
    assert "1.75x the mean" in text and "expert parallel over 2 ranks" in text
    assert "hottest expert 0 of model.layers.0.mlp, 62.5%" in text


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path, _ = make_tiny_moe(tmp_path_factory.mktemp("moe"), "qwen3_moe")
    return path


def test_profile_prints_the_expert_load_of_a_tiny_moe(capsys, moe_path, tmp_path):
    rc = main(["profile", "--model", moe_path, "--device", "cpu", "--dtype", "float32", "--output",
               str(tmp_path), "--steps", "3", "--batch-size", "2", "--input-len", "8", "--block-size", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    with open(os.path.join(tmp_path, "summary.json")) as f:
        summary = json.load(f)
    load = summary["expert_load"]
    # Layers 0 and 2 are sparse (mlp_only_layers=[1]); each profiled decode step routes 2 tokens
    # to 2 of 4 experts in each.
    assert [row["layer"] for row in load["layers"]] == ["model.layers.0.mlp", "model.layers.2.mlp"]
    assert load["steps"] == summary["profiled_steps"] == 3 and load["ep_ranks"] == 1
    for row in load["layers"]:
        assert row["routed"] == 3 * 2 * 2 and row["steps"] == 3
        assert 1.0 <= row["step_imbalance"] <= 4.0 and 2.0 <= row["experts_touched_per_step"] <= 4.0
        assert row["hottest_share"] >= 0.25
    assert "MoE expert load (2 MoE layers, 4 experts, top-2; 24 routed token-expert pairs" in out


def _routed_per_expert(moe_path, **kwargs):
    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.sampling_params import SamplingParams

    # synchronous steps: each launched step is one the requests needed (exact token totals)
    engine = LLMEngine.from_kwargs(model=moe_path, device="cuda", dtype="float32", count_expert_load=True,
                                   max_num_seqs=8, async_scheduling=False, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 7, 9, 11], params)
        while engine.has_unfinished_requests():
            engine.step()
        load = engine.expert_load(10_000)
    finally:
        engine.shutdown()
    return [[sum(step[layer][e] for step in load.counts) for e in range(load.num_experts)]
            for layer in range(len(load.layers))]


@pytest.mark.gpu
def test_counts_inside_cuda_graphs_leave_the_padding_out(moe_path):
    """Decode steps of 3 sequences replay the batch-4 graph (one padding row); the counts inside
    the graph equal eager steps' counts, and every layer routed exactly the real tokens."""
    graphs = _routed_per_expert(moe_path)
    eager = _routed_per_expert(moe_path, enforce_eager=True)
    # 3 prompts of 4 tokens, then 5 decode steps of 3 tokens: 27 tokens, top-2
    assert [sum(layer) for layer in graphs] == [27 * 2, 27 * 2]
    assert graphs == eager
