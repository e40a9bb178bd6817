"""The ``headroom`` command: :func:`main` (the click group of :mod:`service.cli.commands`)
(its options come from :mod:`service.common.settings`).

Light at import (click only): the worker is spawned and re-imports the parent's main
module, and must never import Litestar or torch.
"""

from service.cli.commands import main

__all__ = ["main"]
