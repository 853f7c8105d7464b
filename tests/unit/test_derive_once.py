"""Values derived once in rooflm/config.py and rooflm/sampling_params.py reach every user unchanged:
the sequence cap, the KV pool's cap and the activation reserve in the engine, `rooflm memory` and
`rooflm simulate`; the greedy rule in the sampler and the server."""

import argparse
import io

import pytest
import torch

from rooflm.config import (EngineConfig, SchedulerConfig, default_max_num_seqs, kv_blocks_cap,
                           resolve_max_num_seqs, step_activation_bytes, with_device_defaults)
from rooflm.model.presets import get_preset
from rooflm.perf import commands as perf_commands
from rooflm.perf.gpus import get_gpu
from rooflm.perf.memory import inference_memory
from rooflm.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams
from rooflm.sim import commands as sim_commands

# 80 and 141 GB: the large-GPU default; 24 GB: the smaller one.
GPUS = ["h100", "h200", "rtx4090"]


def _parse(register, argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(argv)


def _engine_cap(gpu_key, max_num_seqs=None):
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
    resolved = with_device_defaults(config, "cuda", device_memory_gb=get_gpu(gpu_key).mem_gb)
    return resolved.scheduler.max_num_seqs


def _simulator_replica(gpu_key, model="llama-3-8b", extra=()):
    args = _parse(sim_commands.register, ["simulate", "--gpu", gpu_key, "--no-calibration", *extra])
    name, config = sim_commands.model_config_of(model)
    replica, _ = sim_commands.replica_config(args, config, gpu_key, 1, [])
    return replica


def _memory_plan_text(gpu_key, extra=()):
    args = _parse(perf_commands.register, ["memory", "--model", "llama-3-8b", "--gpu", gpu_key, *extra])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    return out.getvalue()


@pytest.mark.parametrize("gpu_key", GPUS)
def test_engine_simulator_and_memory_plan_default_to_the_same_sequence_cap(gpu_key):
    mem_gb = get_gpu(gpu_key).mem_gb
    want = default_max_num_seqs("cuda", mem_gb)
    assert want == (1024 if mem_gb >= 70 else 512)
    assert resolve_max_num_seqs(None, "cuda", mem_gb) == want
    assert _engine_cap(gpu_key) == want
    assert _simulator_replica(gpu_key).scheduler.max_num_seqs == want
    assert inference_memory(get_preset("llama-3-8b"), gpu_mem_gb=mem_gb).max_num_seqs == want
    assert f"{want} seqs of logits" in _memory_plan_text(gpu_key)


def test_a_sequence_cap_that_is_set_reaches_all_three():
    assert resolve_max_num_seqs(64, "cuda", 141.0) == 64
    assert _engine_cap("h200", 64) == 64
    assert _simulator_replica("h200", extra=["--max-num-seqs", "64"]).scheduler.max_num_seqs == 64
    assert inference_memory(get_preset("llama-3-8b"), gpu_mem_gb=141.0, max_num_seqs=64).max_num_seqs == 64
    assert "64 seqs of logits" in _memory_plan_text("h200", ["--max-num-seqs", "64"])


def test_the_memory_plan_reserves_the_engines_activation_estimate():
    config = get_preset("llama-3-8b")
    for tp in (1, 2):
        plan = inference_memory(config, gpu_mem_gb=80.0, tp=tp, max_num_batched_tokens=4096)
        assert plan.activation_reserve == step_activation_bytes(config, 4096, 1024, 2.0, tp)
    # The MLP's three intermediate rows and the residual and norm output per token, fp32 logits per sequence.
    tiny = step_activation_bytes(config, 1, 0, 1)
    assert tiny == 2 * config.hidden_size + 3 * config.intermediate_size
    assert step_activation_bytes(config, 0, 1, 2) == 4 * config.vocab_size


def test_the_simulated_pool_stops_at_full_length_sequences():
    """A small model on a large GPU: the planner's pool is far past every sequence at full length."""
    replica = _simulator_replica("h200", model="smollm2-135m", extra=["--max-model-len", "2048"])
    assert replica.num_blocks == kv_blocks_cap(replica.scheduler.max_num_seqs, 2048, replica.block_size)
    assert kv_blocks_cap(3, 64, 16) == 12 and kv_blocks_cap(3, 65, 16) == 15


def test_the_engine_resolves_its_cap_and_pool_through_config(tmp_path):
    from rooflm.llm import LLM
    from tests.models.tiny_models import make_tiny_model

    src, _ = make_tiny_model(tmp_path, "llama")
    info = LLM(model=src, device="cpu", dtype="float32", max_model_len=64, block_size=4).engine.info
    assert info.max_num_seqs == resolve_max_num_seqs(None, "cpu") == 256
    # 1 GB of CPU pool holds far more than 256 sequences of 64 tokens: the cap is what is left.
    assert info.num_blocks == kv_blocks_cap(256, 64, 4)


@pytest.mark.parametrize("temperature,greedy", [
    (0.0, True), (1e-30, True), (GREEDY_TEMPERATURE_EPS / 2, True),
    (GREEDY_TEMPERATURE_EPS, False), (0.7, False)])
def test_one_greedy_rule_for_the_sampler_and_the_server(temperature, greedy):
    from rooflm.layers.sampler import SamplingMetadata, SamplingRow
    from rooflm.server import protocol

    params = SamplingParams(temperature=temperature)
    assert params.greedy is greedy
    meta = SamplingMetadata.build([SamplingRow(params, [1], [], None)], 8, "cpu")
    assert meta.all_greedy is greedy
    if not greedy:  # what the sampler divides by is the request's own temperature
        assert meta.temperature.item() == pytest.approx(temperature)
    request = protocol.CompletionRequest(model="m", prompt="x", temperature=temperature)
    assert request.sampling_params(4).greedy is greedy


def test_a_temperature_below_the_rule_samples_the_argmax():
    """No division by a near-zero temperature anywhere: such a row takes the argmax and its
    seed draws nothing."""
    from rooflm.layers.sampler import Sampler, SamplingMetadata, SamplingRow

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    generator = torch.Generator().manual_seed(0)
    row = SamplingRow(SamplingParams(temperature=1e-7, seed=1), [1], [], generator)
    out = Sampler()(logits, SamplingMetadata.build([row], 4, "cpu"))
    assert out.sampled_token_ids.tolist() == [1]
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())


def test_simulator_replica_holds_sliding_windows_like_the_engine():
    """The simulator's KV pool has the engine's KV cache groups (engine/kv_groups.py): Gemma 2's
    sliding layers hold their window, in blocks of 21 layers, twice as many as of 42."""
    replica = _simulator_replica("h200", model="gemma-2-9b")
    assert replica.kv_windows == (None, 4096)
    full = _simulator_replica("h200", model="llama-3-8b")
    assert full.kv_windows == (None,)
