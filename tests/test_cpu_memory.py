"""Resident memory of the CPU engine: what loading the default model holds beyond its
weights, and the GGUF's one-time conversion run in a child process (its reader, the
tokenizer's build and transformers' config classes never enter the serving process).

Memory is measured (``/proc/self/status``, Linux), never time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine.common import load_errors as errors  # noqa: E402
from engine.loader.config_cache import cached_config  # noqa: E402
from engine.loader.convert_child import convert_ahead  # noqa: E402
from engine.loader.default_model import converted_dir  # noqa: E402
from engine.loader.meta_build import materialize  # noqa: E402
from engine.loader.resolve import resolve_model  # noqa: E402

MiB = 1 << 20
# What a CPU load may hold beyond its weights: the RoPE table, the C kernels' library,
# the KV pool's first pages, the allocator's slack. Before its mends it was 110 MiB
# (sympy through Module.to_empty, the file's mapped pages of the small tensors).
LOAD_SLACK = 40 * MiB

_LOAD_SCRIPT = """
import sys
def vm(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.loader.convert_child import convert_ahead
convert_ahead(None)  # as the worker does: the config's facts cached by a child
base = vm("VmRSS:")
engine = Engine(EngineConfig(device="cpu", kv_cache=64 << 20, min_context=256))
print(base, vm("VmHWM:"), engine.info.weight_bytes, "sympy" in sys.modules,
      "transformers.models.auto.configuration_auto" in sys.modules)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_cpu_load_of_the_default_model_holds_its_weights_and_little_else(default_model_dir):
    done = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    base, peak, weights, sympy, auto_config = done.stdout.split()
    grown = int(peak) - int(base)
    assert grown <= int(weights) + LOAD_SLACK, (
        f"the load's peak is {grown / MiB:.0f} MiB above the imports, its weights {int(weights) / MiB:.0f} MiB")
    assert (sympy, auto_config) == ("False", "False")


def test_materialize_gives_every_tensor_storage_as_to_empty_does():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[1].register_buffer("table", torch.zeros(5, dtype=torch.float64))
    model[0].register_buffer("unset", None)
    model[0].register_buffer("steps", torch.zeros(2, dtype=torch.int64), persistent=False)
    assert materialize(model, "cpu") is model
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device.type == "cpu" and t.is_contiguous(), name
    assert isinstance(model[0].weight, torch.nn.Parameter) and model[0].weight.requires_grad
    assert model[0].weight.shape == (3, 4) and model[1].table.dtype == torch.float64
    assert model[0].steps.dtype == torch.int64 and "steps" not in model[0].state_dict()
    assert model[0].unset is None
    assert model(torch.ones(2, 4)).shape == (2, 3)  # real storage: it runs


def _no_conversion_here(*args, **kwargs):
    raise AssertionError("converted in this process")


def test_convert_ahead_converts_in_a_child_and_caches_the_facts(tiny_gguf, monkeypatch):
    import engine.loader.gguf_convert as gguf_convert

    monkeypatch.setattr(gguf_convert, "convert_gguf", _no_conversion_here)
    convert_ahead(str(tiny_gguf))
    folder = converted_dir(tiny_gguf)
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert cached_config(folder) is not None  # the child read the config: the worker need not
    assert resolve_model(str(tiny_gguf)) == folder  # found, not converted again

    def no_child(*args, **kwargs):
        raise AssertionError("a child started for a model already converted")

    monkeypatch.setattr(subprocess, "run", no_child)
    convert_ahead(str(tiny_gguf))
    convert_ahead(str(folder))  # a Hugging Face folder: nothing to convert


def test_convert_ahead_raises_the_child_s_error_and_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 64)
    with pytest.raises(errors.CorruptWeights, match="broken.gguf is not a readable GGUF file.*download it again"):
        convert_ahead(str(bad))
    models = tmp_path / "cache" / "models"
    assert not models.exists() or [p for p in models.iterdir() if p.is_dir()] == []  # no folder, not even a partial one
    convert_ahead(str(tmp_path / "absent.gguf"))  # not a file: the engine's own resolve says so


def test_a_child_that_dies_is_a_model_load_error_naming_its_exit(tiny_gguf, tmp_path, monkeypatch):
    crash = tmp_path / "crash.py"
    crash.write_text("import os, sys\nprint('converting...', file=sys.stderr)\nos._exit(9)\n")
    real_run = subprocess.run

    def run_crash(cmd, **kwargs):
        return real_run([cmd[0], str(crash)], **kwargs)

    monkeypatch.setattr(subprocess, "run", run_crash)
    with pytest.raises(errors.ModelLoadError, match=r"conversion of tiny-qwen3.gguf stopped \(exit code 9\): converting"):
        convert_ahead(str(tiny_gguf))
    report = json.dumps({"kind": "NotAnError", "message": "odd"})
    crash.write_text(f"import sys\nprint({report!r})\nsys.exit(3)\n")
    with pytest.raises(errors.ModelLoadError, match="^odd$") as caught:
        convert_ahead(str(tiny_gguf))
    assert type(caught.value) is errors.ModelLoadError  # an unknown kind falls back to the base class
    assert not (converted_dir(tiny_gguf) / "config.json").exists()


def test_the_worker_converts_ahead_of_its_engine(tiny_gguf, monkeypatch):
    """The worker's engine factory runs after the conversion: a factory that would convert
    in-process finds the folder there."""
    from engine.common.config import EngineConfig
    from engine.worker import process as worker

    seen = []

    def factory_probe(config):
        seen.append((converted_dir(tiny_gguf) / "config.json").is_file())
        return "engine"

    monkeypatch.setattr(worker.importlib, "import_module", lambda name: type("M", (), {"Engine": factory_probe}))
    config = worker.WorkerConfig(engine=EngineConfig(model=str(tiny_gguf), device="cpu"), parent_pid=os.getpid())
    sent = []
    pipe = type("Pipe", (), {"send": lambda self, message: sent.append(message)})()
    assert worker._make_engine(config, pipe) == "engine" and seen == [True]
    assert Path(converted_dir(tiny_gguf)).is_dir()
    # The converted folder is named to the service before the engine loads.
    assert sent == [worker.ModelFolder(model_dir=str(converted_dir(tiny_gguf)))]


def _rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/status")
def test_a_cpu_pool_gives_the_memory_of_free_pages_back():
    """Written pages are resident; released ones leave the process's memory and read as
    zeros, the others keep their keys and values."""
    from engine.kvcache.pool import KVPool

    pool = KVPool(num_layers=4, num_pages=257, page_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                  device="cpu")  # 16 KiB a page per layer buffer: 32 MiB in all
    before = _rss()
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.fill_(1.0)
    written = _rss() - before
    assert written >= 28 * MiB
    given = pool.release_memory(list(range(1, 200)))
    assert given == 199 * 16 * 4 * 64 * 4 * 8
    assert before + written - _rss() >= given - 4 * MiB  # it left this process's resident memory
    for buf in (*pool.k_buffers, *pool.v_buffers):
        assert float(buf[16:200 * 16].abs().max()) == 0.0  # released pages read as zeros
        assert bool((buf[:16] == 1.0).all()) and bool((buf[200 * 16:] == 1.0).all())  # the rest intact
    assert pool.release_memory([]) == 0


def test_clearing_the_prefix_cache_gives_a_cpu_pool_s_memory_back(default_model_dir):
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine
    from engine.wire.messages import GenerateRequest, SamplingParams

    engine = Engine(EngineConfig(device="cpu", kv_cache=256 << 20))
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(GenerateRequest(request_id=f"r{i}", prompt_token_ids=list(range(100 + i, 612 + i)),
                                           sampling=sp))
    while engine.has_work():
        engine.step()
    cached = engine.radix.evictable_pages()
    assert cached >= 4 * 512 // 16
    given = []
    real = engine.pool.release_memory
    engine.pool.release_memory = lambda pages: given.append(real(pages)) or given[-1]
    assert engine.evict_prefix_cache(reason="test") == cached
    assert given and given[0] >= cached * engine.kv_page_bytes * 3 // 4  # whole OS pages of each page's rows
