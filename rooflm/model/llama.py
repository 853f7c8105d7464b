"""The Llama family: Llama 2/3/3.1, Mistral, SmolLM2, Qwen2/2.5 (q/k/v bias) and Qwen3
(RMSNorm over each q and k head). Pre-norm RMSNorm, a SiLU gated MLP, one window for every
layer: the decoder's parts with every option off (model/spec.py llama_spec), so every fused
path applies, the native C decoder and the training lab included.
"""

from __future__ import annotations

from rooflm.model.decoder import CausalLM
from rooflm.model.spec import llama_spec


class LlamaForCausalLM(CausalLM):
    spec_of = staticmethod(llama_spec)
