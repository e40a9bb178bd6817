"""Convert a GGUF's metadata in a short-lived child process, ahead of the engine's load.

The one-time conversion (config, tokenizer, generation config:
:func:`engine.loader.gguf_convert.convert_gguf` with ``weights=False``) reads the file
with gguf's ``GGUFReader``, which parses the vocabulary into some 160 MiB of numpy
objects, and builds the tokenizer through transformers; the first reading of the new
``config.json`` imports transformers' ``AutoConfig`` (77 MiB) before its facts are
cached (:mod:`engine.loader.config_cache`). Measured under ``headroom serve`` on the
default model, a worker that did both in-process peaked at 648 MiB resident, 250 MiB
above its later steady state, and glibc keeps much of it. Run in a child, that memory
ends with the child: the process that serves never holds it.

The child is ``python -m engine.loader.convert_child MODEL`` (an empty ``MODEL`` for the
default model): it resolves the model as the engine will
(:func:`engine.loader.resolve.resolve_model`) and reads its config once, which caches
the facts. It dies with its parent (``prctl``) and reports a failure as one JSON line
on stdout, ``{"kind", "message"}``, which :func:`convert_in_child` raises again as the
same :mod:`engine.common.load_errors` class; the conversion publishes its folder by a
rename, so a child killed half-way leaves no folder under the final name. The warnings
the conversion logged (a corrupt file's NaN values...) come back as one JSON line,
``{"warnings": [...]}``, and the parent logs them: its captured stderr is not shown.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from engine.common import load_errors as errors
from engine.loader.config_cache import cached_config
from engine.loader.default_model import converted_dir
from engine.loader.hf_config import load_model_config
from engine.loader.resolve import gguf_file, resolve_model

log = logging.getLogger(__name__)

_FAILED = 3  # the child's exit code for a conversion error it reported


def convert_ahead(path: str | Path | None) -> None:
    """Convert the GGUF behind ``path`` (:func:`gguf_file`) into the cache and cache its
    config's facts now, in a child process (:func:`convert_in_child`), when
    either is not there yet; nothing for anything else. The worker calls it before it
    builds its engine, so the process that serves never holds gguf's reader, the
    tokenizer's build or transformers' config classes; the engine's own
    :func:`resolve_model` then finds the folder.

    Raises:
        Any :class:`~engine.common.load_errors.ModelLoadError` of the GGUF conversion or of
        reading its config.
    """
    gguf = gguf_file(path)
    if gguf is None:
        return
    out = converted_dir(gguf)
    if (out / "config.json").is_file() and cached_config(out) is not None:
        return
    log.info("converting the metadata of %s into %s and reading its config (once, in a child process)", gguf, out)
    started = time.monotonic()
    convert_in_child(path, gguf.name)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - started)


def convert_in_child(model: str | Path | None, name: str) -> None:
    """Resolve ``model`` (a GGUF file, a folder holding one, a store name; None for the
    default model) and read its config in a child process; ``name`` is what messages
    call it.

    Raises:
        ModelLoadError (or the subclass the child raised: CorruptWeights,
            UnsupportedArchitecture, UnsupportedGGUFType, UnsupportedConfig...): the
            conversion failed; also when the child could not start or was killed (the
            message names the exit status and the last lines it printed).
    """
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the engine package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "engine.loader.convert_child", "" if model is None else str(model)]
    try:
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except OSError as e:
        raise errors.ModelLoadError(f"cannot start the conversion of {name} ({e})") from e
    if done.returncode == 0:
        for warning in _reported(done.stdout, "warnings") or ():
            log.warning("%s", warning)
        return
    if done.returncode == _FAILED:
        report = _reported(done.stdout, "kind")
        if report is not None:
            kind = getattr(errors, str(report.get("kind")), None)
            if not (isinstance(kind, type) and issubclass(kind, errors.ModelLoadError)):
                kind = errors.ModelLoadError
            raise kind(str(report.get("message")))
    tail = "; ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
    raise errors.ModelLoadError(f"the conversion of {name} stopped ({how}){': ' + tail if tail else ''}")


def _reported(stdout: str, key: str) -> dict | list | None:
    """The last JSON object line of the child's ``stdout`` holding ``key``: the whole
    report for ``kind``, the list for ``warnings``."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and key in report:
            return report if key == "kind" else report[key]
    return None


class _Kept(logging.Handler):
    """Keeps the messages of the warnings logged, for the parent to log."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(argv: list[str]) -> int:
    from engine.common.parent_death import die_with_parent

    die_with_parent()
    kept = _Kept()
    logging.getLogger("engine").addHandler(kept)
    try:
        load_model_config(resolve_model(argv[0] or None))
    except errors.ModelLoadError as e:
        print(json.dumps({"kind": type(e).__name__, "message": str(e)}), flush=True)
        return _FAILED
    if kept.messages:
        print(json.dumps({"warnings": kept.messages}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
