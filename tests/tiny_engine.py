"""A tiny random model (conftest's ``tiny_dir``) as an engine on the CPU with pages of
:data:`PAGE_SIZE` tokens, for the tests that drive an engine step by step and count its
pages (``test_oom.py``, ``test_fault_hook.py``, ``test_resize.py``...).
"""

from __future__ import annotations

from engine.common.config import EngineConfig
from engine.core.engine import Engine

PAGE_SIZE = 4


def tiny_engine(model: str, num_pages: int, **overrides) -> Engine:
    """An engine over ``model`` (a folder) on the CPU: ``num_pages`` pages of
    :data:`PAGE_SIZE` tokens; ``overrides`` go to :class:`EngineConfig`."""
    return Engine(EngineConfig(**{"model": model, "device": "cpu", "page_size": PAGE_SIZE, "num_pages": num_pages,
                                  **overrides}))
