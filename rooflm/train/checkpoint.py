"""Checkpoints a run can resume from, and that rooflm and transformers can load as a model.

A checkpoint directory holds:
  config.json         the model's shape (rooflm.model.hf_config.hf_config_dict)
  model.safetensors   the weights under HF's names, q/k/v and gate/up split back apart
  trainer_state.pt    step, optimizer, LR scheduler, loss scaler, RNG states and the losses so far

Weights are written in the dtype they train in (fp32 master weights), so a resumed run
starts from bit-identical parameters; together with the optimizer state and the data
order (a function of the step, see data.py) it continues the same loss curve.
Under FSDP the full state is gathered to rank 0, which alone writes.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from rooflm.model.hf_config import hf_config_dict
from rooflm.train.causal import CausalLM, hf_state_dict

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"


def _full_model_state(model: CausalLM, sharded: bool) -> dict[str, torch.Tensor]:
    if not sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _full_optimizer_state(model: CausalLM, optimizer, sharded: bool) -> dict:
    if not sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(directory: str, model: CausalLM, optimizer, scheduler, scaler, step: int, losses: list[float],
         train_config: dict, sharded: bool, is_main: bool) -> None:
    """Write a checkpoint after `step` optimizer steps (every rank calls this; rank 0 writes)."""
    from safetensors.torch import save_file

    weights = _full_model_state(model, sharded)
    optim_state = _full_optimizer_state(model, optimizer, sharded)
    if not is_main:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        # The weights are the fp32 master copy; say so, or transformers loads them as bf16.
        json.dump(dict(hf_config_dict(model.cfg), torch_dtype="float32"), f, indent=2)
        f.write("\n")
    save_file(hf_state_dict(model, weights.items()), os.path.join(directory, WEIGHTS_FILE),
              metadata={"format": "pt", "step": str(step)})
    state = {
        "step": step,
        "optimizer": optim_state,
        "scheduler": scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "losses": list(losses),
        "train_config": train_config,
    }
    torch.save(state, os.path.join(directory, STATE_FILE))


def read_state(directory: str) -> dict:
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--resume {directory}: no {STATE_FILE} (not a rooflm train checkpoint)")
    return torch.load(path, map_location="cpu", weights_only=False)


def restore(state: dict, model: CausalLM, optimizer, scheduler, scaler, sharded: bool) -> int:
    """Load optimizer / scheduler / scaler / RNG state (the weights were loaded with the model);
    returns the step to continue from."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    cuda_rng: Optional[list] = state["rng"].get("cuda")
    if cuda_rng is not None and torch.cuda.is_available() and len(cuda_rng) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_rng)
    return int(state["step"])
