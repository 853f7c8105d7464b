"""The memory planner against the field's worked examples and hand-computed cases."""

import argparse
import dataclasses
import io
import math

import pytest

from rooflm.config import ModelConfig
from rooflm.model.presets import get_preset
from rooflm.perf import commands
from rooflm.perf.memory import (
    activation_bytes_per_token_per_layer,
    inference_memory,
    param_counts,
    training_memory,
    weight_bytes,
)

TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)


def test_llama_7b_kv_cache_at_8192_tokens_is_4_3_gb():
    plan = inference_memory(get_preset("llama-2-7b"), kv_dtype="bf16", context=8192)
    assert plan.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # 0.5 MiB
    assert round(plan.kv_bytes_per_seq / 1e9, 1) == 4.3


def test_gqa_shrinks_the_kv_cache_by_the_group_factor():
    mha = inference_memory(get_preset("llama-2-7b"), context=4096)
    gqa = inference_memory(get_preset("llama-3-8b"), context=4096)
    assert gqa.kv_bytes_per_token == mha.kv_bytes_per_token / 4  # 8 KV heads instead of 32
    fp8 = inference_memory(get_preset("llama-3-8b"), kv_dtype="fp8", context=4096)
    assert fp8.kv_bytes_per_token == gqa.kv_bytes_per_token / 2
    tp8 = inference_memory(get_preset("llama-3-8b"), context=4096, tp=8)
    assert tp8.kv_bytes_per_token == gqa.kv_bytes_per_token / 8


def test_blocks_and_concurrent_sequences():
    plan = inference_memory(get_preset("llama-3-8b"), context=8192, gpu_mem_gb=80,
                            block_size=16, gpu_memory_utilization=0.9)
    block_bytes = 16 * 2 * 32 * 8 * 128 * 2
    assert plan.block_bytes == block_bytes
    expected_pool = 80e9 * 0.9 - plan.weights - plan.activation_reserve
    assert plan.num_blocks == math.floor(expected_pool / block_bytes)
    assert plan.blocks_per_seq == 512
    assert plan.max_concurrent_seqs == plan.num_blocks // 512
    assert plan.weights == pytest.approx(2 * get_preset("llama-3-8b").num_params())


def test_quantized_weights_convert_the_linear_layers_only():
    config = get_preset("llama-3-8b")
    counts = param_counts(config)
    assert counts.total == config.num_params()
    int4 = weight_bytes(config, "int4")
    assert int4 == pytest.approx(counts.linear * (0.5 + 4 / 128) + (counts.embedding + counts.other) * 2)
    assert weight_bytes(config, "bf16", tp=2) < weight_bytes(config, "bf16") / 2 + counts.other * 2 + 1


def test_adam_in_bf16_needs_16_bytes_per_parameter_before_activations():
    config = get_preset("llama-2-7b")
    mem = training_memory(config, num_gpus=8, dtype="bf16")
    assert mem.state_bytes_per_param == 16  # 2 weight + 2 grad + 4 master + 4 m + 4 v
    assert mem.weights == 2 * mem.num_params and mem.master_weights == 4 * mem.num_params
    assert mem.adam_moments == 8 * mem.num_params
    assert mem.states == pytest.approx(16 * 6.74e9, rel=0.01)  # ~108 GB for "7B"
    # DDP replicates the states; FSDP divides them by N.
    assert mem.ddp_per_gpu() == mem.states + mem.activations
    assert mem.fsdp_per_gpu() == pytest.approx(mem.states / 8 + mem.fsdp_gathered + mem.activations)
    assert training_memory(config, dtype="fp32").state_bytes_per_param == 16  # 4 + 4 + 8


def test_activations_by_hand():
    seq = 32
    per_layer = activation_bytes_per_token_per_layer(TINY, seq, act_bytes=2, flash_attention=True)
    # 4h + 2q + 2kv + 4I elements of 2 bytes, plus an fp32 log-sum-exp per head.
    assert per_layer == (4 * 64 + 2 * 64 + 2 * 32 + 4 * 128) * 2 + 4 * 4
    eager = activation_bytes_per_token_per_layer(TINY, seq, act_bytes=2, flash_attention=False)
    assert eager - per_layer == 4 * seq * 2  # the softmax row of every head

    mem = training_memory(TINY, micro_batch=2, seq_len=seq)
    head = 2 * 64 * 2 + 1000 * (2 + 4)
    assert mem.activations == 2 * seq * (2 * per_layer + head)
    assert mem.activations_checkpointed == 2 * seq * (2 * 64 * 2 + per_layer + head)
    assert mem.activations_checkpointed < mem.activations
    kept = (3 * 64 + 2 * 64 + 2 * 32 + 2 * 128) * 2 + 4 * 4  # matmul and attention outputs
    # Two layers: keeping matmul outputs plus one recomputed layer would exceed keeping all.
    assert mem.activations_selective == min(2 * seq * (2 * kept + per_layer + head), mem.activations)
    deep = training_memory(dataclasses.replace(TINY, num_hidden_layers=16), micro_batch=2, seq_len=seq)
    assert deep.activations_selective == 2 * seq * (16 * kept + per_layer + head)
    assert deep.activations_checkpointed < deep.activations_selective < deep.activations
    assert mem.ddp_per_gpu("selective") == mem.states + mem.activations_selective
    assert mem.ddp_per_gpu(True) == mem.ddp_per_gpu("full")
    with pytest.raises(ValueError, match="selective"):
        mem.ddp_per_gpu("some")


def _run(argv):
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    out = io.StringIO()
    rc = args.func(args, out=out)
    return rc, out.getvalue()


def test_memory_command():
    rc, text = _run(["memory", "--model", "llama-2-7b", "--context", "8192", "--gpu-mem", "80"])
    assert rc == 0
    assert "4.29 GB" in text and "concurrent sequences" in text
    rc, text = _run(["memory", "--model", "llama-2-7b", "--train", "--num-gpus", "8"])
    assert rc == 0
    assert "16 bytes per parameter" in text and "FSDP" in text and "checkpointing" in text
    rc, _ = _run(["memory", "--model", "llama-2-7b", "--train", "--dtype", "int4"])
    assert rc == 2


def test_sliding_layers_holding_their_window_multiply_concurrent_sequences():
    """KV cache groups (engine/kv_groups.py): Gemma 2 9B at 8192 tokens keeps 21 full layers and
    21 of 4096-token windows; a Gemma-3-12B shape (5 sliding of 1024 per global) at 32k holds
    the 8 global layers' history and a window for the other 40: over 3x the sequences."""
    plan = inference_memory(get_preset("gemma-2-9b"), context=8192, gpu_mem_gb=141, block_size=64)
    assert plan.kv_layout.windows == (None, 4096) and plan.kv_layout.group_size == 21
    assert plan.blocks_per_seq == 128
    assert plan.hybrid_blocks_per_seq == 128 + (-(-4095 // 64) + 2)
    # Blocks of 21 layers: twice as many as of 42, each sequence needing 194 of them, not 256.
    assert plan.hybrid_num_blocks in (2 * plan.num_blocks, 2 * plan.num_blocks + 1)
    assert plan.hybrid_concurrent_seqs == plan.hybrid_num_blocks // 194
    g3 = dataclasses.replace(
        get_preset("gemma-2-9b"), hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        sliding_window=1024, max_position_embeddings=131072, vocab_size=262208,
        layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(48)))
    plan = inference_memory(g3, context=32768, gpu_mem_gb=141, block_size=64)
    assert plan.kv_layout.group_size == 8 and plan.hybrid_blocks_per_seq == 512 + 5 * 18
    assert plan.hybrid_concurrent_seqs >= 3 * plan.max_concurrent_seqs > 0
    # A model without sliding layers: one group, the same figure.
    plan = inference_memory(get_preset("llama-2-7b"), context=8192)
    assert not plan.kv_layout.hybrid and plan.hybrid_concurrent_seqs == plan.max_concurrent_seqs


def test_memory_command_prints_both_with_sliding_layers():
    rc, text = _run(["memory", "--model", "gemma-2-9b", "--context", "8192", "--gpu-mem", "141"])
    assert rc == 0
    assert "with a full-history cache (--disable-hybrid-kv-cache-manager)" in text
    assert "with sliding-window layers holding only their window" in text and "window 4096" in text
    rc, text = _run(["memory", "--model", "llama-2-7b", "--context", "8192", "--gpu-mem", "80"])
    assert "sliding-window" not in text
