"""The one GPU gate: a test that needs CUDA is marked `gpu` (a decorator or a module's
`pytestmark`); without CUDA it is skipped here, saying so. `pytest -m gpu` runs only those,
`pytest -m 'not gpu'` only the rest, plain `pytest` everything this machine can run."""

import fcntl
import os
import tempfile

# One intra-op thread for the suite and every process it starts (servers, CLI runs, TP ranks):
# its models are tiny, and an OpenMP region of 2 threads on a 2-core machine waits for its
# slowest thread, which a neighbouring job (or the suite's own server subprocess) keeps off a
# core: a tiny Gemma 3's 32 greedy tokens took 13.5 s at 2 threads and 1.8 s at 1 beside other
# jobs (4.3 and 0.4 CPU seconds: the rest is spinning). Set before torch loads libgomp, which
# reads it once; a test that needs more threads sets them itself (test_native_decode), and
# OMP_NUM_THREADS=2 pytest ... still asks for two.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit():  # the same, should a plugin have loaded torch first
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton's interpreter on a machine without CUDA, set before any test module is collected: a
# @triton.jit function decorated before TRITON_INTERPRET=1 stays a compiled-mode function, and an
# interpreted kernel that calls it fails ("Cannot call @triton.jit'd outside of the scope of a
# kernel"). tests/distributed collects before tests/kernels/conftest.py sets it, and its modules
# import kernel modules (through tests/models); every kernel test then failed in the suite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The directories whose files start servers, process groups and real models run first: under
# --dist loadfile each xdist worker takes whole files in this order as it frees up, and long files
# at the end of the queue left one worker running alone for minutes.
_FIRST = ("tests/server/", "tests/distributed/", "tests/models/", "tests/train/")


def _run_order(item) -> int:
    path = item.nodeid
    return next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_order)  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    # A skipif put first: pytest reports the first skipif that holds, so this reason wins over a
    # test's own capability skipif (sm_89+, two GPUs) on a machine without CUDA.
    skip = pytest.mark.skipif(True, reason="marked gpu: needs a CUDA GPU, and torch sees none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip, append=False)


# scripts/test.sh runs the suite on two pytest-xdist workers (a file's tests stay on one worker:
# --dist loadfile, so module-scoped servers and models are built once). A test that measures
# the machine's speed is marked `exclusive`: it takes this lock exclusively, every other test
# takes it shared, so it runs with no test of the other worker beside it. Without xdist the lock
# is only ever this process's.
_LOCK_PATH = os.path.join(tempfile.gettempdir(),
                          f"rooflm-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}.lock")


@pytest.fixture(autouse=True)
def _exclusive_or_shared(request):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    with open(_LOCK_PATH, "a") as lock:
        exclusive = request.node.get_closest_marker("exclusive") is not None
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
