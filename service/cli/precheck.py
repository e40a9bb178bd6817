"""What every command that loads a model checks before it loads anything: the model's
files (:func:`check_model_before_loading`: the tokenizer, the weights on disk), and for
``headroom serve``, before it opens its port (torch-free), the settings checked against
the model and the machine: a tensor-parallel size that does not split the model or asks for
more GPUs than there are, ``--cpu-experts`` above the model's MoE layers, a
``--kv-cache-dtype`` block format (``q8_0``, ``q4_0``) for heads that are not whole blocks, a
``--kv-cache`` below one ``--min-context``, a fixed KV pool on the CPU past the host's
available memory, a CUDA attention backend (``triton``, ``flashinfer``) on the CPU. Each is
refused with exit code 2 and the fix, like any bad option; what cannot be read here (a
GGUF not converted yet, a machine without NVML) is left to the worker, which refuses it
in one log line.

Light at import, like the whole of :mod:`service.cli`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from service.cli.exits import EXIT_USAGE, check_model_path, fail


def model_config_if_readable(model: str | None) -> Any:
    """The model's :class:`engine.common.config.ModelConfig` when its ``config.json`` is on disk
    (a Hugging Face folder, a GGUF already converted), else None: converting a GGUF
    needs torch and is the worker's job. A config the loader refuses is None too (the
    worker says why)."""
    from engine.common.load_errors import ModelLoadError
    from engine.loader.default_model import converted_dir
    from engine.loader.hf_config import load_model_config
    from engine.loader.resolve import gguf_file, resolve_model

    try:
        gguf = gguf_file(model)
        folder = converted_dir(gguf) if gguf is not None else resolve_model(model)
        if not (Path(folder) / "config.json").is_file():
            return None
        return load_model_config(folder)
    except (ModelLoadError, OSError):
        return None


def check_model_before_loading(model: str | None, *, tokenizer: bool, convert: bool = False) -> None:
    """The one check every command that loads a model runs before it loads anything:
    exit 2 naming the fix for a ``--model`` that names no model
    (:func:`~service.cli.exits.check_model_path`), for a folder without the tokenizer
    files the loader reads (with ``tokenizer``: the commands that turn text into ids,
    serve and generate; a GGUF's conversion without them is named, to be deleted and
    converted again), and for weights that are not on disk
    (:func:`engine.loader.weight_check.check_weights_on_disk`: no safetensors, a GGUF
    without the model's tensors), each with the loader's own message.

    A GGUF not converted yet is converted (its metadata, once) with ``convert`` (the
    commands that import torch anyway: plan, generate, bench engine); serve, which never
    imports torch, reads its tensor table only (a file shorter than its last tensor's
    end is refused), checks the cache folder the conversion goes to can be written, and
    leaves the rest to its worker, which refuses it in one log line.
    """
    check_model_path(model)
    from engine.common.load_errors import ModelLoadError
    from engine.loader.default_model import converted_dir
    from engine.loader.gguf_tensors import open_tensors
    from engine.loader.hf_config import load_model_config
    from engine.loader.resolve import gguf_file, locate_model, resolve_model
    from engine.loader.weight_check import check_weights_on_disk

    try:
        gguf = gguf_file(model)
        if gguf is not None and convert:
            folder = resolve_model(model)
        else:
            folder = converted_dir(gguf) if gguf is not None else locate_model(model)
    except (ModelLoadError, OSError) as exc:  # e.g. the default model's package missing
        fail(f"cannot load the model: {exc}", EXIT_USAGE)
    try:
        if not (folder / "config.json").is_file():
            if gguf is not None:  # not converted yet: its tensor table read, a short file refused
                open_tensors(gguf)
                _check_writable(folder.parent, gguf)  # where the worker will write the conversion
            return
        config = load_model_config(folder)  # first, as plan reads it: a broken config.json is named alike
        if tokenizer:
            from engine.text.tokenizer import check_tokenizer_files

            if gguf is not None and not (folder / "tokenizer.json").is_file():
                raise ModelLoadError(f"{folder}, the conversion of {gguf}, has no tokenizer.json (a half-written or "
                                     "damaged copy): delete that folder, and the next start converts the file again")
            check_tokenizer_files(str(folder))
        check_weights_on_disk(folder, config, gguf)
    except (ModelLoadError, FileNotFoundError) as exc:
        fail(f"cannot load the model: {exc}", EXIT_USAGE)


def _check_writable(store: Path, gguf: Path) -> None:
    """Refuse a conversion folder (``HEADROOM_CACHE_DIR``'s ``models``) the worker could
    not write, before serve opens its port: a file in its place, a read-only disk. It
    creates the folder, as the conversion would, and a probe folder it removes again.

    Raises:
        ModelLoadError: the folder cannot be created or written, in the conversion's words
            (:func:`engine.common.load_errors.cache_not_writable`).
    """
    import tempfile

    from engine.common.load_errors import cache_not_writable

    try:
        store.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=store))
    except OSError as e:
        raise cache_not_writable(gguf.name, store, e) from e


def visible_gpus() -> int | None:
    """GPUs a CUDA process here would see: NVML's count, cut to ``CUDA_VISIBLE_DEVICES``'
    entries when set; None without NVML (no NVIDIA driver, no pynvml)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, NVMLError_LibraryNotFound, _DriverNotLoaded...
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([p for p in visible.split(",") if p.strip()]))
    return count


def torch_without_gpu_support() -> str | None:
    """The installed torch's version when it is a build without CUDA or ROCm (read from
    its ``version.py``, without importing torch), else None (a GPU build, or unknown)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    fields = dict(re.findall(r"^(\w+)\s*(?::[^=]*)?=\s*(.+?)\s*$", text, re.M))
    if fields.get("cuda") == "None" and fields.get("hip") == "None":
        return fields.get("__version__", "?").strip("'\"")
    return None


def check_backend_for_device(backend: str, device: str) -> None:
    """Refuse (exit 2) ``--attention-backend triton`` or ``flashinfer`` (CUDA kernels) for a
    run on the CPU: ``--device cpu``, or ``auto`` with a torch built without CUDA, which
    the worker would find only once it started."""
    if backend not in ("triton", "flashinfer"):
        return
    cpu_build = torch_without_gpu_support() if device == "auto" else None
    if device == "cpu" or cpu_build is not None:
        on, gpu = ((f" (the installed torch {cpu_build} is built without CUDA)", "a CUDA build of torch")
                   if cpu_build is not None else ("", "--device cuda"))
        fail(f"--attention-backend {backend} runs CUDA kernels, and --device {device} runs on the CPU{on}: use "
             f"--attention-backend auto or torch there, or {gpu}", EXIT_USAGE)


def check_before_serving(settings: Any) -> None:
    """Refuse (exit 2, one line naming the fix) settings the model or the machine cannot
    honour; settings that need no model facts cost nothing here."""
    from engine.common.errors import SettingRefused
    from engine.common.faults import FaultInjector

    try:
        FaultInjector.from_env()  # a malformed test hook refused now, not after the model loads
    except ValueError as exc:
        fail(f"{exc}; fix or unset it", EXIT_USAGE)
    if settings.vram_timeline:
        from service.vram.simulated import TimelineError, load_timeline

        try:  # read again when the watcher starts; a bad file is refused before the port opens
            load_timeline(settings.vram_timeline, settings.device_total)
        except TimelineError as exc:
            fail(str(exc), EXIT_USAGE)
    if settings.device.startswith("cuda"):
        # Waiting for a GPU (the worker's answer to a CUDA that fails to start) cannot
        # help a torch built without one.
        cpu_build = torch_without_gpu_support()
        if cpu_build is not None:
            fail(f"--device {settings.device}: the installed torch {cpu_build} is built without CUDA; install "
                 "a CUDA build into this Python (e.g. `pip install --force-reinstall torch --index-url "
                 "https://download.pytorch.org/whl/cu128`) or use --device cpu", EXIT_USAGE)
    check_backend_for_device(settings.attention_backend, settings.device)

    world = settings.tensor_parallel_size
    wants_layers = any(n.isdecimal() and int(n) > 0 for n in (settings.cpu_experts, settings.cpu_layers))
    if (world == 1 and not wants_layers and settings.kv_cache is None and settings.num_pages is None
            and settings.kv_cache_dtype == "auto" and settings.min_context is None
            and settings.sources.get("page_size") == "default"):
        return
    from engine.core.settings_fit import check_for_model
    from engine.parallel.split import check_gpu_count

    try:
        if world > 1 and settings.device != "cpu":
            gpus = visible_gpus()
            # "auto" on a machine without a GPU runs the ranks on the CPU (gloo).
            if gpus is not None and (gpus > 0 or settings.device.startswith("cuda")):
                check_gpu_count(world, gpus)
        mc = model_config_if_readable(settings.model)
        if mc is not None:
            if settings.device == "auto" and torch_without_gpu_support() is not None:
                settings = dataclasses.replace(settings, device="cpu")  # all that auto can pick here
            check_for_model(settings, mc)
    except SettingRefused as exc:
        fail(str(exc), EXIT_USAGE)


def note_gpu_only_settings(device: str, cpu_layers: str, device_limit: int | None, device_total: int | None) -> None:
    """One line on stderr where ``--cpu-layers N`` or ``--device-limit`` is given for a run
    on the CPU (``--device cpu``, or ``auto`` on a machine without a usable GPU) with no
    simulated card (``--device-total``, which they split and limit): they have no effect
    there, as ``headroom plan`` says, and the run goes on."""
    import click

    from engine.common.gpu_settings import gpu_only_settings

    given = gpu_only_settings(cpu_layers, device_limit)
    if not given or device_total is not None:
        return
    on_cpu = device == "cpu" or device == "auto" and (torch_without_gpu_support() is not None or visible_gpus() == 0)
    if not on_cpu:
        return
    click.echo(f"headroom: note: {' and '.join(given)}: no effect on the CPU (every layer runs there already; they "
               "split or limit a GPU's plan)", err=True)
