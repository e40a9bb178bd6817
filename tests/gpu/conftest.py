"""GPU tests run only where CUDA is present."""

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


@pytest.fixture
def capped():
    """Make this process's allocator stop where a card of N bytes would: N minus the
    CUDA context, which lives outside the allocator. Undone after the test."""
    total = torch.cuda.get_device_properties(0).total_memory

    def cap(limit: int) -> None:
        torch.cuda.init()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        context = (total - free) - torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction((limit - context) / total)
        return limit - context  # what the allocator may hold

    yield cap
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
