"""``headroom doctor``: :mod:`service.doctor`'s checks, one line each, exit 1 on a FAIL.

Light at import (click only), like the whole of :mod:`service.cli`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from service.cli.options import config_option


@click.command(
    epilog="Exit code 0 when nothing FAILs (WARNs included), 1 otherwise. Reads the same "
    "config file (--config) and HEADROOM_* variables as serve."
)
@config_option
def doctor(config_path: Path | None) -> None:
    """Check torch, the GPU driver, kernels, model, config, port, token and service."""
    from service.doctor import FAIL, OK, run_checks

    failed = False
    for check in run_checks(config_path):
        colour = {OK: "green", FAIL: "red"}.get(check.status, "yellow")
        status = click.style(f"{check.status:<4}", fg=colour)
        click.echo(f"{status} {check.name:<8} {check.detail}")
        if check.fix:
            click.echo(f"{'':<4} {'':<8} fix: {check.fix}")
        failed = failed or check.status == FAIL
    sys.exit(1 if failed else 0)
