import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct from its GGUF) as users get it on a
    CPU: Q4_1/Q8_0 blocks kept quantized (rooflm/quant/), loaded once."""
    from rooflm import LLM
    return LLM(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_exact():
    """The same GGUF dequantized to float32 (--quantization none): the weights HF uses."""
    from rooflm import LLM
    return LLM(dtype="float32", device="cpu", quantization="none")
