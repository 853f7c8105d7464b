"""rooflm: an LLM inference engine that runs at the hardware roofline and says where it stands."""

from rooflm.sampling_params import SamplingParams
from rooflm.version import __version__


def __getattr__(name):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from rooflm.llm import LLM
        return LLM
    if name == "LLMEngine":
        from rooflm.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "__version__"]
