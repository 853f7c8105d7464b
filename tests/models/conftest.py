import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct from its GGUF), loaded once."""
    from rooflm import LLM
    return LLM(dtype="float32", device="cpu")
