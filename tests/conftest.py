"""The one GPU gate: a test that needs CUDA is marked `gpu` (a decorator or a module's
`pytestmark`); without CUDA it is skipped here, saying so. `pytest -m gpu` runs only those,
`pytest -m 'not gpu'` only the rest, plain `pytest` everything this machine can run."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    # A skipif put first: pytest reports the first skipif that holds, so this reason wins over a
    # test's own capability skipif (sm_89+, two GPUs) on a machine without CUDA.
    skip = pytest.mark.skipif(True, reason="marked gpu: needs a CUDA GPU, and torch sees none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip, append=False)
