"""One training step of rooflm's CausalLM against HF transformers, on tiny random models of each
family: the same loss and the same gradient for every HF-named parameter (fp32)."""

import pytest
import torch
import torch.nn.functional as F

from rooflm.train.causal import CausalLM, hf_state_dict
from rooflm.train.trainer import build_model
from tests.models.tiny_models import make_tiny_model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("family,tied,attention", [
    ("llama", False, "gqa"), ("llama", True, "mha"), ("qwen2", False, "gqa"), ("qwen3", True, "mqa"),
])
def test_one_step_gradients_match_transformers(tmp_path, family, tied, attention):
    path, hf = make_tiny_model(tmp_path, family, tied=tied, attention=attention)
    hf.train()
    _, lm, _, _ = build_model(path, "safetensors", torch.device("cpu"), seq_len=48, seed=0)
    model = CausalLM(lm).train()

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (3, 49), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    loss = model(inputs, targets)
    loss.backward()
    hf_logits = hf(input_ids=inputs).logits
    hf_loss = F.cross_entropy(hf_logits.float().flatten(0, 1), targets.flatten())
    hf_loss.backward()

    assert abs(loss.item() - hf_loss.item()) < 1e-5 * abs(hf_loss.item())
    ours = hf_state_dict(model, [(n, p.grad) for n, p in model.named_parameters()])
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    if tied:
        theirs.pop("lm_head.weight", None)  # the same tensor as the embedding
    assert set(ours) == set(theirs)
    worst = max((rel_err(ours[n], theirs[n]), n) for n in theirs)
    assert worst[0] < 1e-4, f"largest relative gradient error {worst[0]:.2e} at {worst[1]}"


def test_sliding_window_matches_transformers(tmp_path):
    """Mistral with a window shorter than the sequence: the training mask, not plain causal."""
    path, hf = make_tiny_model(tmp_path, "mistral", sliding_window=8, attn_implementation="eager")
    _, lm, _, _ = build_model(path, "safetensors", torch.device("cpu"), seq_len=24, seed=0)
    model = CausalLM(lm)
    tokens = torch.randint(0, 256, (2, 25), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens[:, :-1])
        theirs = hf(input_ids=tokens[:, :-1]).logits
    assert rel_err(ours, theirs) < 1e-4
