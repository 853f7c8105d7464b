"""The FLOP count behind MFU, and the verdict's choice of limit."""

import pytest

from rooflm.model.presets import get_preset
from rooflm.perf.memory import param_counts
from rooflm.train.measure import train_flops_per_sequence, verdict


def test_training_flops_are_six_per_matmul_parameter_per_token_plus_causal_attention():
    cfg = get_preset("llama-3.2-1b")
    s = 2048
    counts = param_counts(cfg)
    matmul_params = counts.linear + cfg.vocab_size * cfg.hidden_size  # tied: the head is the embedding
    attention = 3 * cfg.num_hidden_layers * 4 * cfg.q_size * (s * (s + 1) // 2)
    assert train_flops_per_sequence(cfg, s) == pytest.approx(6 * matmul_params * s + attention, rel=1e-3)


@pytest.mark.parametrize("kernels,data,limit", [
    (dict(matmul=0.8, attention=0.1, communication=0.0, other=0.05), 0.0, "compute"),
    (dict(matmul=0.2, attention=0.0, communication=0.0, other=0.7), 0.0, "memory"),
    (dict(matmul=0.3, attention=0.0, communication=0.6, other=0.1), 0.0, "communication"),
    (dict(matmul=0.1, attention=0.0, communication=0.0, other=0.1), 0.05, "host"),
])
def test_verdict_names_the_largest_cause(kernels, data, limit):
    _, causes = verdict(1.0, kernels, data, mfu=0.5)
    assert max(causes, key=causes.get) == limit


def test_saved_activations_match_rooflm_memory_train(tmp_path):
    """What the backward pass keeps (every tensor saved for it that is not a parameter) against
    rooflm memory --train's activation accounting: a 2-layer Llama-3.2-1B-wide model, fp32."""
    import dataclasses

    import torch

    from rooflm.model.llama import LlamaForCausalLM
    from rooflm.perf.memory import training_memory
    from rooflm.train.causal import CausalLM

    cfg = dataclasses.replace(get_preset("llama-3.2-1b"), num_hidden_layers=2, vocab_size=8192)
    lm = LlamaForCausalLM(cfg, max_positions=256)
    lm.init_dummy_weights(0)
    model = CausalLM(lm)
    storages = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (1, 257))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)
    predicted = training_memory(cfg, seq_len=256, dtype="fp32").activations
    assert abs(saved / predicted - 1) < 0.10, (saved, predicted)
