"""Test setup. Without a GPU, Triton kernels run under the Triton interpreter on CPU tensors."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def large_gpu_memory():
    """For a test that needs many GiB of GPU memory: such tests run one at a time across pytest-xdist's workers (a
    file lock), and each hands its cached blocks back to the driver when done. Four of them side by side beside 8
    workers ran an 80 GB H100 out of memory (bench/results/2026-12-07-h100-run56/a-tests.log), with other workers
    still holding the cached blocks of big tests they had finished."""
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "strictnorm-large-gpu-memory.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _wait_for_free_gpu_memory()
        try:
            yield
        finally:
            if HAS_CUDA:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_for_free_gpu_memory(fraction: float = 0.5, limit_s: float = 120.0) -> None:
    """Until half the GPU's memory is free (other workers' tests end and hand their big cached blocks back, see
    _hand_back_big_cached_blocks), at most limit_s: a 2^31-element test beside 7 workers holding 8-14 GB each ran an
    80 GB H100 out of memory (bench/results/2026-12-07-h100-run58, call b)."""
    import time

    if not HAS_CUDA:
        return
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free >= fraction * total:
            return
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def _hand_back_big_cached_blocks():
    """After each test, a worker that caches more than 2 GiB of GPU memory hands it back to the driver, so that the
    large_gpu_memory tests of other workers find it free."""
    yield
    if HAS_CUDA and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 2 << 30:
        torch.cuda.empty_cache()


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run (a failure's report shows it, see pytest_runtest_makereport); the
    environment variable STRICTNORM_TEST_SEED fixes it, to replay a failure."""
    fixed = os.environ.get("STRICTNORM_TEST_SEED")
    return int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure's seed in its report (the seed is a fixture, not part of the test id), and, where
    STRICTNORM_FAILURE_LOG names a file, the whole failure appended to it at once: a run cut by a time limit
    (or under pytest-xdist, which prints failures only at the end) still leaves what failed and why."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    seed = item.funcargs.get("seed") if hasattr(item, "funcargs") else None
    if seed is not None:
        report.sections.append(("seed", f"{seed} (replay: STRICTNORM_TEST_SEED={seed})"))
    path = os.environ.get("STRICTNORM_FAILURE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}) seed={seed}\n{report.longreprtext}\n")
