"""JSON read from a model's answer as the API's clients read it.

Python's ``json`` reads ``NaN``, ``Infinity`` and ``-Infinity``, which no JSON has, and
numbers past a double's range (``1e999``, valid JSON text) as infinity, and writes each
back as ``NaN`` or ``Infinity``: a tool call's arguments that JavaScript's and Go's
readers refuse, and that this server refuses in a later turn's history
(``service.api.tool_checks``). :func:`loads` refuses them instead, so a parser that
takes a call from an answer writes it back as JSON any client reads.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a double's range")
    return value


DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def loads(text: str) -> Any:
    """``json.loads(text)`` without the numbers no JSON carries (see the module docstring).

    Raises:
        ValueError: text that is not JSON, ``NaN``/``Infinity``, or a number past a
            double's range.
        RecursionError: JSON nested past the reader's depth.
    """
    return DECODER.decode(text)
