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
