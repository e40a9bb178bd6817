"""A GGUF's conversion holds its metadata only; the float weights are written into it
when a load first reads them, once, atomically, and never for a load that keeps the
file's blocks or a plan that needs the config alone."""

from __future__ import annotations

import json
import os

import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_gguf_convert import dies_at_fifth_tensor  # noqa: E402

from engine.commands.plan import build_plan  # noqa: E402
from engine.common.config import EngineConfig  # noqa: E402
from engine.common.load_errors import ModelLoadError, ModelNotFound  # noqa: E402
from engine.loader import gguf_convert, gguf_hf_tensors  # noqa: E402
from engine.loader.default_model import GGUF_SOURCE  # noqa: E402
from engine.loader.gguf_convert import convert_gguf, ensure_gguf_weights  # noqa: E402
from engine.loader.load import load_model  # noqa: E402
from engine.loader.resolve import resolve_model  # noqa: E402

GiB = 1 << 30


def _tensors(folder):
    return sorted(p.name for p in folder.rglob("*.safetensors"))


def test_resolve_writes_the_metadata_only(tiny_gguf):
    folder = resolve_model(str(tiny_gguf))
    for name in ("config.json", "generation_config.json", "tokenizer.json", GGUF_SOURCE):
        assert (folder / name).is_file(), name
    assert _tensors(folder) == []
    assert json.loads((folder / GGUF_SOURCE).read_text())["gguf"] == str(tiny_gguf.resolve())


def test_resolving_a_finished_conversion_sweeps_a_dead_converters_leftovers(tiny_gguf):
    folder = resolve_model(str(tiny_gguf))
    dead = folder.parent / f".{folder.name}.partial-999999999"  # no such process
    alive = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    dead.mkdir()
    alive.mkdir()
    assert resolve_model(str(tiny_gguf)) == folder
    assert not dead.exists()
    assert alive.exists()  # a conversion still running beside it keeps its folder


def test_plan_and_a_quantized_cpu_load_write_no_weights(tiny_gguf):
    plan = build_plan(EngineConfig(model=str(tiny_gguf), device="cpu", device_total=4 * GiB))
    assert plan.fits
    folder = resolve_model(str(tiny_gguf))
    assert _tensors(folder) == []
    model, _ = load_model(folder, "cpu", torch.float32, quantized_gguf=tiny_gguf)
    assert _tensors(folder) == []


def test_a_dense_load_writes_the_weights_once(tiny_gguf, monkeypatch):
    folder = resolve_model(str(tiny_gguf))
    load_model(folder, "cpu", torch.float32)
    assert _tensors(folder) == ["model.safetensors"]
    assert not list(folder.glob(".weights.partial-*"))

    def must_not_write(*args, **kwargs):
        raise AssertionError("weights written again")

    monkeypatch.setattr(gguf_convert, "_write_weights", must_not_write)
    assert ensure_gguf_weights(folder) is False
    dense, config = load_model(resolve_model(str(tiny_gguf)), "cpu", torch.float32)
    quant, _ = load_model(folder, "cpu", torch.float32, quantized_gguf=tiny_gguf)
    ids = torch.tensor([[5, 70, 3, 200]])
    assert torch.equal(dense.model.embed_tokens(ids), quant.model.embed_tokens(ids).float())


def test_an_interrupted_weights_step_leaves_nothing_taken_as_complete(tiny_gguf, monkeypatch):
    folder = resolve_model(str(tiny_gguf))
    stale = folder / ".weights.partial-999999999"  # a dead writer's leftovers
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    real = gguf_hf_tensors.dequantize_tensor
    monkeypatch.setattr(gguf_hf_tensors, "dequantize_tensor", dies_at_fifth_tensor(real))
    with pytest.raises(KeyboardInterrupt):
        load_model(folder, "cpu", torch.float32)
    assert _tensors(folder) == []
    assert not list(folder.glob(".weights.partial-*"))

    monkeypatch.setattr(gguf_hf_tensors, "dequantize_tensor", real)
    load_model(folder, "cpu", torch.float32)
    assert _tensors(folder) == ["model.safetensors"]


def test_sharded_weights_publish_the_index_last(tiny_gguf, monkeypatch):
    folder = resolve_model(str(tiny_gguf))
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 64 * 1024)  # several shards
    renamed = []
    real_replace = os.replace

    def replace(src, dst):
        renamed.append(os.path.basename(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(gguf_convert.os, "replace", replace)
    assert ensure_gguf_weights(folder) is True
    assert len(renamed) > 2 and renamed[-1] == "model.safetensors.index.json"
    assert set(renamed[:-1]) == set(_tensors(folder))
    load_model(folder, "cpu", torch.float32)


def test_a_moved_gguf_is_found_again_and_a_missing_one_is_named(tiny_gguf, tmp_path):
    folder = resolve_model(str(tiny_gguf))
    moved = tmp_path / "elsewhere" / tiny_gguf.name
    moved.parent.mkdir()
    tiny_gguf.rename(moved)
    with pytest.raises(ModelNotFound, match="pass the GGUF file"):
        load_model(folder, "cpu", torch.float32)
    assert resolve_model(str(moved)) == folder  # the content names the folder; the record follows
    load_model(folder, "cpu", torch.float32)
    assert _tensors(folder) == ["model.safetensors"]


def test_a_gguf_changed_since_is_refused(tiny_gguf):
    folder = resolve_model(str(tiny_gguf))
    with tiny_gguf.open("ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(ModelLoadError, match="changed since"):
        ensure_gguf_weights(folder)
    assert _tensors(folder) == []


def test_an_old_style_conversion_with_weights_still_loads(tiny_gguf, monkeypatch):
    from engine.loader.default_model import converted_dir

    folder = convert_gguf(tiny_gguf, converted_dir(tiny_gguf))  # weights written up front
    (folder / GGUF_SOURCE).unlink()  # as versions before the record wrote it
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", must_not_convert)
    monkeypatch.setattr(gguf_convert, "_write_weights", must_not_convert)
    assert resolve_model(str(tiny_gguf)) == folder
    load_model(folder, "cpu", torch.float32)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_a_hugging_face_folder_is_left_alone(tmp_path):
    assert ensure_gguf_weights(tmp_path) is False
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_write_once(tiny_gguf):
    from concurrent.futures import ThreadPoolExecutor

    folder = resolve_model(str(tiny_gguf))
    with ThreadPoolExecutor(2) as pool:  # flock locks per open file, threads included
        wrote = sorted(pool.map(lambda _: ensure_gguf_weights(folder), range(2)))
    assert wrote == [False, True]
    assert _tensors(folder) == ["model.safetensors"]
    load_model(folder, "cpu", torch.float32)
