"""Where a served GGUF's default sampling comes from, as ``/api/show``'s parameters show
it through the real server: the packaged default model's file passed with ``--model``
(here a renamed copy) has its model card's values as when ``--model`` is left out (it
had temperature 1.0, which makes the 135M model babble); a GGUF's llama.cpp
``general.sampling.*`` keys are its defaults."""

from __future__ import annotations

import shutil

import gguf
import pytest

from engine.loader.default_model import DEFAULT_MODEL_SAMPLING, default_gguf_path


def _shown_parameters(server) -> dict[str, float]:
    with server.client() as http:
        r = http.post("/api/show", json={"model": "default"})
    assert r.status_code == 200, r.text
    return {k: float(v) for k, v in (line.split() for line in r.json()["parameters"].splitlines())}


@pytest.mark.slow
def test_the_packaged_model_by_path_samples_as_the_default_model(tmp_path, start_server):
    copy = tmp_path / "my-smollm.gguf"
    shutil.copyfile(default_gguf_path(), copy)
    shown = _shown_parameters(start_server(["--model", str(copy)]))
    assert shown["temperature"] == DEFAULT_MODEL_SAMPLING["temperature"]
    assert shown["top_p"] == DEFAULT_MODEL_SAMPLING["top_p"]


@pytest.mark.slow
def test_a_gguf_samples_by_its_llama_cpp_sampling_metadata(tmp_path, start_server, make_tiny_hf_model):
    """Every key of llama.cpp's that headroom reads; a GGUF without them keeps OpenAI's
    defaults (tests/test_api_defaults.py)."""
    from test_gguf_convert import VOCAB, add_byte_level_tokenizer, write_gguf

    keys = {"temp": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "penalty_repeat": 1.1}

    def tokenizer_and_sampling(writer) -> None:
        add_byte_level_tokenizer(writer)
        for key, value in keys.items():
            (writer.add_int32 if key == "top_k" else writer.add_float32)(f"general.sampling.{key}", value)

    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen3", make_tiny_hf_model("qwen3", None, vocab_size=VOCAB), tokenizer=tokenizer_and_sampling)
    assert {getattr(gguf.Keys.General, f"SAMPLING_{k.upper()}") for k in keys} <= set(gguf.GGUFReader(path).fields)
    shown = _shown_parameters(start_server(["--model", str(path)]))
    assert shown == pytest.approx({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                   "repeat_penalty": 1.1})
