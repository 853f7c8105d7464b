"""What a SpeculativeConfig names: its proposer, and the step strategy that runs it."""

from __future__ import annotations

from rooflm.config import EngineConfig, ModelConfig
from rooflm.engine.step_strategy import StepStrategy
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


def speculative_strategy(config: EngineConfig, target: ModelConfig, max_model_len: int) -> StepStrategy:
    """The engine's step strategy with speculative decoding (engine/step_strategy.py's
    strategy_for): the host path, which hands over to the device loop at attach where it runs."""
    from rooflm.spec.decoder import SpecDecoder
    from rooflm.spec.strategy import SpecHostStep
    proposer = make_proposer(config, target, max_model_len)
    decoder = SpecDecoder(config.speculative, proposer, max_model_len, config.runtime.deterministic)
    return SpecHostStep(decoder)
