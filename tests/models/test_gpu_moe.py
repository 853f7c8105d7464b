"""MoE families end to end on the GPU (`pytest -m gpu`): the Triton path (fused_moe experts,
Triton attention) against the torch reference path, CUDA graphs (full and piecewise) against
eager steps, and FP8 attention linears beside the MoE block (the FP8 path's fallback)."""

import pytest

from tests.models.test_gpu_e2e import PROMPTS, check_greedy_close, generate
from tests.models.test_moe_parity import MOE_FAMILIES, make_tiny_moe

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_tiny_moe_triton_matches_reference(tmp_path, family):
    path, _ = make_tiny_moe(tmp_path, family)
    ref = generate(path, PROMPTS, "reference", True, dtype="float32")
    fast = generate(path, PROMPTS, "triton", True, dtype="float32")
    check_greedy_close(fast, ref)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_tiny_moe_graphs_match_eager(tmp_path, family):
    path, _ = make_tiny_moe(tmp_path, family)
    for batch in (1, 3, 8):
        eager = generate(path, PROMPTS[:batch], "triton", True)
        graphs = generate(path, PROMPTS[:batch], "triton", False, piecewise_cuda_graphs=False)
        assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    # prefill chunks through the piecewise graphs (each layer's MoE block inside a piece)
    eager = generate(path, PROMPTS, "triton", True, max_num_batched_tokens=64)
    pieces = generate(path, PROMPTS, "triton", False, max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in pieces] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tiny_moe_fp8_attention_beside_bf16_experts(tmp_path, family):
    path, _ = make_tiny_moe(tmp_path, family)
    bf16 = generate(path, PROMPTS, "triton", True)
    fp8 = generate(path, PROMPTS, "triton", True, quantization="fp8")
    check_greedy_close(fp8, bf16)
