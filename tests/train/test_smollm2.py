"""The embedded SmolLM2-135M (its GGUF dequantized to fp32) trained for a few steps on a text that
ships with Python: the loss on held-out windows of that text falls."""

import pydoc_data.topics

import pytest
import torch

from rooflm.train.config import TrainConfig
from rooflm.train.trainer import Trainer


def held_out_loss(trainer: Trainer, batches) -> float:
    with torch.no_grad():
        return sum(trainer.model(x, y).item() for x, y in batches) / len(batches)


@pytest.mark.slow
def test_smollm2_training_lowers_the_loss_on_pydoc_topics():
    cfg = TrainConfig(data=pydoc_data.topics.__file__, device="cpu", seq_len=64, micro_batch=2,
                      max_steps=4, lr=3e-4, warmup_steps=1, fused=True, progress=False, profile=False)
    trainer = Trainer(cfg)
    assert trainer.model_cfg.num_params() > 100e6
    # Windows of the same text that training never reads (their sample numbers are far past it).
    held_out = [trainer.data.batch(10_000, 0, 1, 0, 1, 4)]
    before = held_out_loss(trainer, held_out)
    result = trainer.run()
    after = held_out_loss(trainer, held_out)
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    print(f"held-out loss {before:.4f} -> {after:.4f}; training losses {result['losses']}")
    assert after < before - 0.05, (before, after, result["losses"])
