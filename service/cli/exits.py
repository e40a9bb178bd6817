"""How a ``headroom`` command fails: one line on stderr naming the fix, and an exit code
(1 the work failed, 2 a usage error, as click's own usage errors).

Light at import (click only), like the whole of :mod:`service.cli`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

import click

EXIT_USAGE = 2
EXIT_FAILED = 1


# The click context's ``meta`` key a command with ``--json`` sets (:func:`errors_as_json`).
_JSON_ERRORS = "headroom.errors_as_json"


def errors_as_json() -> None:
    """From now on in this command, :func:`fail` also prints its refusal on stdout as
    one JSON object, ``{"error": <message>, "exit_code": <code>}``, for a script that
    parses the command's ``--json`` output."""
    click.get_current_context().meta[_JSON_ERRORS] = True


class JsonErrorsCommand(click.Command):
    """A command whose ``--json`` promises one JSON object on stdout: a usage error that
    click itself finds (an unknown option, a value of the wrong type) is printed there too,
    as :func:`fail` prints the command's own refusals after :func:`errors_as_json`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        wants_json = "--json" in args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if wants_json:
                click.echo(json.dumps({"error": exc.format_message(), "exit_code": exc.exit_code}))
            raise


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``headroom: error: <message>`` on stderr and exit with ``code``; after
    :func:`errors_as_json`, also ``{"error": <message>, "exit_code": <code>}`` on
    stdout."""
    click.echo(f"headroom: error: {message}", err=True)
    context = click.get_current_context(silent=True)
    if context is not None and context.meta.get(_JSON_ERRORS):
        click.echo(json.dumps({"error": message, "exit_code": code}))
    sys.exit(code)


def check_model_path(model: str | None) -> None:
    """Fail fast (exit 2), before torch is imported, for a model that is neither a path
    nor a name in the store, or a path that holds no model (empty, a file that is not a
    .gguf, a folder without config.json or one .gguf file)."""
    if model is None:
        return
    from engine.common.load_errors import ModelNotFound
    from engine.loader.default_model import names_default_model
    from engine.loader.resolve import locate_model
    from engine.loader.store import find_model

    if not model.strip() or Path(model).expanduser().exists():
        try:
            locate_model(model)
        except ModelNotFound as exc:
            fail(f"--model: {exc}", EXIT_USAGE)
        return
    try:
        found = find_model(model) or (locate_model(model) if names_default_model(model) else None)
    except ModelNotFound as exc:
        fail(str(exc), EXIT_USAGE)
    if found is None:
        fail(
            f"model not found: {model} (no such file or folder, and no such name in the "
            "store: `headroom models` lists it); pass a Hugging Face model folder, a "
            ".gguf file or a store name with --model (`headroom pull REPO[:FILE]` "
            "fetches one), or leave --model out for the default model",
            EXIT_USAGE,
        )
