"""Where a served GGUF's default sampling comes from, as ``/api/show``'s parameters show
it through the real server: the packaged default model's file passed with ``--model``
(here a renamed copy) has its model card's values as when ``--model`` is left out (it
had temperature 1.0, which makes the 135M model babble)."""

from __future__ import annotations

import shutil

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
