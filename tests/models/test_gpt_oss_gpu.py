"""gpt-oss's tiny model on the GPU (`pytest -m gpu`): the Triton path (sinks in the Triton decode
and prefill kernels, alternating windows, fused_moe with the clamped SwiGLU and biases) against
the torch reference path in fp32; CUDA graphs (full and piecewise) against eager steps."""

import pytest
import torch

from rooflm import LLM
from rooflm.layers.cuda_attention import TritonBackend
from tests.models.test_gpt_oss import make_tiny_gpt_oss
from tests.models.test_gpu_e2e import PROMPTS, check_greedy_close, generate

pytestmark = pytest.mark.gpu


def test_tiny_gpt_oss_runs_its_attention_on_triton(tmp_path):
    """Sinks need no fallback: every layer's attention is the Triton backend's, graphs allowed."""
    path, _ = make_tiny_gpt_oss(tmp_path)
    llm = LLM(model=path, device="cuda", dtype="bfloat16", attention_backend="triton")
    model = llm.engine.runner.model
    assert model.graph_unsafe_reason is None
    assert all(isinstance(layer.self_attn.attn.backend, TritonBackend) for layer in model.model.layers)
    del llm
    torch.cuda.empty_cache()


def test_tiny_gpt_oss_triton_matches_reference(tmp_path):
    path, _ = make_tiny_gpt_oss(tmp_path)
    ref = generate(path, PROMPTS, "reference", True, dtype="float32")
    fast = generate(path, PROMPTS, "triton", True, dtype="float32")
    check_greedy_close(fast, ref)


def test_tiny_gpt_oss_graphs_match_eager(tmp_path):
    path, _ = make_tiny_gpt_oss(tmp_path)
    for batch in (1, 3, 8):
        eager = generate(path, PROMPTS[:batch], "triton", True)
        graphs = generate(path, PROMPTS[:batch], "triton", False, piecewise_cuda_graphs=False)
        check_greedy_close(graphs, eager)
    # prefill chunks through the piecewise graphs (sinks handed to the attention between pieces)
    eager = generate(path, PROMPTS, "triton", True, max_num_batched_tokens=64)
    pieces = generate(path, PROMPTS, "triton", False, max_num_batched_tokens=64)
    check_greedy_close(pieces, eager)
