"""A name table whose entries are imported on first use.

A registry maps names to ``"package.module:attribute"`` strings and imports the module
only when a name is looked up, so the table can be read (which names exist, is this one
known) by code that must not import what the entries need (torch, Triton, FlashInfer),
and the module that holds the table never imports the modules it names: no import
circle between an interface and its implementations. Torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any


class LazyRegistry:
    """``name -> "module:attr"``, resolved (and the result kept) on first :meth:`get`.

    ``kind`` names what the registry holds, for messages (``"attention backend"``).
    """

    def __init__(self, kind: str, entries: dict[str, str]) -> None:
        self.kind = kind
        self._paths = dict(entries)
        self._resolved: dict[str, Any] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._paths or name in self._resolved

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(dict.fromkeys([*self._paths, *self._resolved]))

    def get(self, name: str) -> Any:
        """The object registered under ``name``, its module imported the first time.

        Raises:
            KeyError: no entry of that name (the message lists the known ones).
        """
        if name not in self._resolved:
            if name not in self._paths:
                raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self.names()))}")
            module, _, attr = self._paths[name].partition(":")
            self._resolved[name] = getattr(importlib.import_module(module), attr)
        return self._resolved[name]

    def register(self, name: str) -> Callable[[Any], Any]:
        """A decorator that registers an object already imported (a test's own entry)."""
        def deco(obj: Any) -> Any:
            self._resolved[name] = obj
            return obj

        return deco
