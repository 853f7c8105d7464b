"""Random PEFT LoRA adapters on a tiny HF checkpoint, and HF's merged model of each, for tests.

    path, merged = make_peft_adapter(base_path, out_dir, rank=8, alpha=16, targets=ALL_TARGETS)

init_lora_weights=False leaves A and B random (PEFT's default zeroes B, an adapter that changes
nothing); the adapter is saved with save_pretrained (adapter_config.json +
adapter_model.safetensors), then loaded onto a fresh base and merged (merge_and_unload), so the
reference is PEFT's own merge of what was saved.
"""

from __future__ import annotations

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base(base_path: str):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()


def make_peft_adapter(base_path: str, out_dir, *, rank: int, alpha: float, targets=ALL_TARGETS,
                      rslora: bool = False, seed: int = 0):
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                             lora_dropout=0.0, init_lora_weights=False)
    peft.get_peft_model(_base(base_path), config).save_pretrained(str(out_dir))
    merged = peft.PeftModel.from_pretrained(_base(base_path), str(out_dir)).merge_and_unload()
    return str(out_dir), merged.eval()


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens through HF's forward and KV cache, never stopping at EOS."""
    tokens = []
    input_ids, past = torch.tensor([prompt_ids]), None
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            tokens.append(tok)
            input_ids = torch.tensor([[tok]])
    return tokens
