"""The proposer a SpeculativeConfig names."""

from __future__ import annotations

from rooflm.config import EngineConfig, ModelConfig
from rooflm.spec.proposer import Proposer


def make_proposer(config: EngineConfig, target: ModelConfig, max_model_len: int) -> Proposer:
    spec = config.speculative
    if spec.speculative_method == "ngram":
        from rooflm.spec.ngram import NgramProposer
        return NgramProposer(spec.ngram_prompt_lookup_max, spec.ngram_prompt_lookup_min)
    if spec.speculative_method == "draft":
        from rooflm.spec.draft import DraftModelProposer
        return DraftModelProposer(config, target, max_model_len)
    raise ValueError(f"unknown speculative_method {spec.speculative_method!r}")
