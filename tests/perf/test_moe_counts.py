"""The toolkit counts a mixture of experts: total parameters held, active ones per token, and the
weights a decode step reads (only the experts its batch routes to), in roofline, memory and the
simulator's cost model."""

import pytest

from rooflm.engine.report import BatchShape
from rooflm.model.presets import get_preset
from rooflm.perf.gpus import get_gpu
from rooflm.perf.memory import param_counts, weight_bytes
from rooflm.perf.roofline import expected_active_experts, phase_step_cost, step_cost
from rooflm.sim.cost_model import RooflineCostModel


@pytest.mark.parametrize("name,total,active", [("qwen3-30b-a3b", 30.5e9, 3.35e9),  # Qwen's 30.5B / 3.3B
                                               ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mistral's 46.7B / 12.9B
                                               ("olmoe-1b-7b", 6.92e9, 1.28e9)])  # AI2's 6.9B / 1.3B
def test_total_and_active_parameters(name, total, active):
    config = get_preset(name)
    assert config.num_params() == pytest.approx(total, rel=5e-3)
    assert config.num_active_params() == pytest.approx(active, rel=5e-3)
    assert param_counts(config).total == config.num_params()
    assert weight_bytes(config, "bf16") == 2 * config.num_params()


def test_decode_reads_the_routed_experts_only():
    config = get_preset("qwen3-30b-a3b")
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.expert_intermediate_size
    one = phase_step_cost(config, "decode", 1, 512)
    experts = next(op for op in one.ops if op.name == "moe experts")
    assert experts.weight_bytes == layers * 8 * 3 * h * inter * 2  # top-8 of 128, bf16
    # everything a token computes with, but the embedding table (gathered row by row)
    read = sum(op.weight_bytes for op in one.ops)
    embedding = config.vocab_size * h * 2
    assert read == pytest.approx(2 * config.num_active_params() - embedding, rel=1e-3)
    many = phase_step_cost(config, "decode", 256, 512)
    touched = expected_active_experts(256, 128, 8)
    assert 127 < touched < 128
    assert next(op for op in many.ops if op.name == "moe experts").weight_bytes == pytest.approx(
        layers * touched * 3 * h * inter * 2)


def test_qwen3_moe_dense_layers_keep_their_mlp():
    from dataclasses import replace
    config = replace(get_preset("qwen3-30b-a3b"), mlp_only_layers=(0, 47))
    step = step_cost(config, num_decode_seqs=1, decode_context_tokens=100)
    names = [op.name for op in step.ops]
    assert "gate_up_proj" in names and "moe experts" in names
    gate_up = next(op for op in step.ops if op.name == "gate_up_proj")
    assert gate_up.weight_bytes == 2 * config.hidden_size * 2 * config.intermediate_size * 2


def test_simulator_prices_an_moe_step_at_its_roofline():
    config, gpu = get_preset("qwen3-30b-a3b"), get_gpu("h200")
    model = RooflineCostModel(config, gpu)
    for seqs in (1, 64):
        shape = BatchShape(num_decode_seqs=seqs, decode_context_tokens=seqs * 300)
        want = step_cost(config, **shape.as_kwargs()).floor_seconds(gpu)
        assert model.floor_seconds(shape) == pytest.approx(want, rel=1e-9)
    small = model.floor_seconds(BatchShape(num_decode_seqs=1, decode_context_tokens=300))
    large = model.floor_seconds(BatchShape(num_decode_seqs=64, decode_context_tokens=64 * 300))
    assert large > 5 * small  # batch 64 reads nearly every expert; batch 1 only 8 a layer
