"""GPU tests run only where CUDA is present."""

import gc

import pytest
import torch

GiB = 1 << 30


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """After each test: engines hold reference cycles (and graphs, pools), so collect
    them and give their memory back, or the next test plans a card already full of
    this process's leftovers (a served worker counts them as another process's)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def capped():
    """Make this process's allocator stop where a card of N bytes would: N minus the
    CUDA context, which lives outside the allocator. Undone after the test."""
    total = torch.cuda.get_device_properties(0).total_memory

    def cap(limit: int) -> None:
        gc.collect()
        torch.cuda.init()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        context = (total - free) - torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction((limit - context) / total)
        return limit - context  # what the allocator may hold

    yield cap
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
