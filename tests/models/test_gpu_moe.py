"""MoE families end to end on the GPU (`pytest -m gpu`): the Triton path (fused_moe experts,
Triton attention) against the torch reference path, CUDA graphs (full and piecewise) against
eager steps, and FP8 attention linears beside the MoE block (the FP8 path's fallback)."""

import pytest

import rooflm.envs as envs
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
    """A graph pads the batch to its captured size, and the fused MoE kernel's tiles follow the
    number of (token, expert) pairs, so bf16 sums may round differently: greedy-close, not equal."""
    path, _ = make_tiny_moe(tmp_path, family)
    for batch in (1, 3, 8):
        eager = generate(path, PROMPTS[:batch], "triton", True)
        graphs = generate(path, PROMPTS[:batch], "triton", False, piecewise_cuda_graphs=False)
        check_greedy_close(graphs, eager)
    # prefill chunks through the piecewise graphs (each layer's MoE block inside a piece)
    eager = generate(path, PROMPTS, "triton", True, max_num_batched_tokens=64)
    pieces = generate(path, PROMPTS, "triton", False, max_num_batched_tokens=64)
    check_greedy_close(pieces, eager)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tiny_moe_fp8_attention_beside_bf16_experts(tmp_path, family):
    """FP8 W8A8 attention linears beside the bf16 MoE block: the pre-norm writes qkv's E4M3 codes
    (DecoderLayer._forward_fp8's attention half) and the MoE block runs as itself. The codes are
    the ones each linear would make from its own float input (ROOFLM_FP8_FUSED_QUANT=0), so the
    tokens are the same."""
    path, _ = make_tiny_moe(tmp_path, family)
    runs = []
    for fused in ("1", "0"):
        with envs.override("ROOFLM_FP8_FUSED_QUANT", fused):
            runs.append(generate(path, PROMPTS, "triton", True, quantization="fp8"))
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
