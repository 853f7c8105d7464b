"""rooflm: an LLM inference engine that runs at the hardware roofline and says where it stands."""

from rooflm.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from rooflm.llm import LLM
        return LLM
    if name == "LLMEngine":
        from rooflm.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def _version() -> str:
    # One source of truth: pyproject.toml's version, as installed.
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("rooflm")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _version()
