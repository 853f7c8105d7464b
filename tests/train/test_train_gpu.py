"""rooflm train on a CUDA GPU: gradients against HF transformers, the compiled bf16 step, FSDP over
NCCL in a world of one. Run with `pytest -m gpu tests/train` (benchmarks/train.sh does)."""

import pytest
import torch
import torch.nn.functional as F

from rooflm.train.causal import CausalLM, hf_state_dict
from rooflm.train.config import TrainConfig
from rooflm.train.trainer import build_model, train
from tests.models.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("gpu-train"), "llama")
    return path


def test_gradients_match_transformers_on_cuda(tmp_path):
    path, hf = make_tiny_model(tmp_path, "qwen3", tied=True)
    hf = hf.cuda().train()
    _, lm, _, _ = build_model(path, "safetensors", torch.device("cuda"), seq_len=64, seed=0)
    model = CausalLM(lm)
    tokens = torch.randint(0, 256, (2, 65), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        hf_logits = hf(input_ids=tokens[:, :-1]).logits
    loss.backward()
    F.cross_entropy(hf_logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    ours = hf_state_dict(model, [(n, p.grad) for n, p in model.named_parameters()])
    for name, p in hf.named_parameters():
        if name == "lm_head.weight":
            continue
        err = float((ours[name] - p.grad).norm() / p.grad.norm())
        assert err < 5e-2, (name, err)  # bf16 matmuls on both sides, rounded in different places


@pytest.mark.parametrize("knobs", [
    dict(precision="bf16", compile=True, fused=True),
    dict(precision="bf16", compile=True, fused=True, sdpa_backend="cudnn"),
    dict(precision="fp16", activation_checkpointing="selective"),
    dict(precision="bf16", parallel="fsdp", activation_checkpointing="full"),
])
def test_training_on_cuda_runs_and_measures(tiny_llama, knobs):
    result = train(TrainConfig(model=tiny_llama, load_format="safetensors", device="cuda", seq_len=128,
                               micro_batch=4, max_steps=8, lr=3e-3, progress=False, **knobs))
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["mfu"] > 0 and result["peak_memory_bytes"] > 0
    assert result["kernels_s"]["matmul"] > 0 and result["verdict"]
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
