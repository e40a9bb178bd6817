"""Memory sizes between bytes and what a person reads or writes.

Torch-free: the service parses its options with :func:`parse_size`, the memory plan
prints its ledger with :func:`fmt_bytes`, and both read the one table below. Inside the
code every size is in bytes.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from engine.common.clip import clip

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# Unit (lower case) -> bytes. The IEC units and the bare letters are binary, as GPU
# memory is counted; ``kb``/``mb``/``gb``/``tb`` are decimal (SI), as disks are sold.
SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 10**3,
    "m": MiB,
    "mib": MiB,
    "mb": 10**6,
    "g": GiB,
    "gib": GiB,
    "gb": 10**9,
    "t": TiB,
    "tib": TiB,
    "tb": 10**12,
    "p": 1 << 50,
    "pib": 1 << 50,
    "pb": 10**15,
    # Read so that a size in exbibytes is refused as beyond any machine (MAX_SIZE), not
    # as text that is no size.
    "e": 1 << 60,
    "eib": 1 << 60,
    "eb": 10**18,
}
PiB = SIZE_UNITS["pib"]
SIZE_EXAMPLES = "e.g. 6GiB, 5.5GiB, 512MiB, 6GB (decimal) or a number of bytes"
# What a size is made of, for the refusal of text that is none.
SIZE_FORM = ("ASCII digits, then B, K/KiB, M/MiB, G/GiB, T/TiB, P/PiB or E/EiB (binary) or KB, MB, GB, TB, PB "
             "or EB (decimal)")
# The largest size a person may write: far beyond any device or host memory, so a
# larger one is a typo (not a plan that "fits" on a card of 10^20 TiB).
MAX_SIZE = PiB

# ASCII only: ``\d`` and ``int()`` take any script's digits ("１GiB" would be 1 GiB). An
# exponent (``1e9``, as TOML and Python write a float) is read; ``1E`` is an exbibyte.
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE](?P<exp>[+-]?[0-9]+))?\s*(?P<unit>[a-zA-Z]*)\s*$",
                   re.ASCII)
# Exponents beyond this are read as this: 10^30 bytes is past MAX_SIZE, and 10^-30 of
# an exbibyte less than a byte, so the size (or its refusal) is the same.
_MAX_EXP = 30


def parse_size(text: str | int | float, *, unitless_min: int = 0) -> int:
    """A memory size in bytes from what a person writes.

    ``"6GiB"``, ``"5.5GiB"``, ``"512MiB"``, ``"64KiB"`` are binary (so are the bare
    ``K``/``M``/``G``/``T``/``P``); ``"6GB"``, ``"512MB"`` are decimal; ``"1048576"``,
    ``"1e9"`` (or an int, or a whole float such as TOML's ``1e9``) are bytes. Case and a
    space before the unit do not matter. Fractions of a unit round down to whole bytes;
    a number of bytes must be whole. Digits are ASCII ones only. Exbibytes (``EiB``,
    ``E``, ``EB``) are read, to be refused as more than :data:`MAX_SIZE`.

    Args:
        text: the size as written (str), or bytes (int, or a float from a config file).
        unitless_min: the least number of bytes written without a unit (a bare number,
            an int or a float) that is taken; a smaller one but 0 is refused as a missing
            unit (``--reserve 2``). 0: any.

    Raises:
        ValueError: not a size (the message names the units taken), a negative one, a
            fractional number of bytes, one above :data:`MAX_SIZE` (1 PiB), or a bare
            number below ``unitless_min``; the message names the fix.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size; write {SIZE_EXAMPLES}")
    if isinstance(text, (int, float)) and text < 0:
        raise ValueError(f"{text} is negative; a size is at least 0 bytes")
    if isinstance(text, int):
        size, bare = text, True
    else:
        # A float is read as its text (1.5 -> "1.5", 1e20 -> "1e+20"): one rule for a
        # config file's number and the same number on the command line.
        shown = repr(text) if isinstance(text, float) else str(text)
        match = _SIZE.match(shown)
        unit = match.group("unit").lower() if match else None
        if match is None or unit not in SIZE_UNITS:
            raise ValueError(f"{clip(repr(shown))} is not a size; write {SIZE_EXAMPLES}: {SIZE_FORM}")
        exact = _bytes_of(match.group("number"), match.group("exp"), SIZE_UNITS[unit])
        bare = unit == ""
        if unit in ("", "b") and exact.denominator != 1 and exact <= MAX_SIZE:
            written = match.group(0).strip()
            number = clip(written[: len(written) - len(match.group("unit"))].strip())
            raise ValueError(f"{number} is not a whole number of bytes: write {number}GiB, {number}MiB or a whole "
                             "number of bytes")
        size = math.floor(exact)
    if size > MAX_SIZE:
        raise ValueError(f"{clip(repr(text))} is more than 1 PiB, beyond any machine's memory; write a size, {SIZE_EXAMPLES}")
    if bare and 0 < size < unitless_min:
        number = str(text).strip()
        raise ValueError(f"{number} without a unit is {fmt_bytes(size)}, less than {fmt_bytes(unitless_min)}; did you "
                         f"mean {number}GiB? (write {number}B for bytes)")
    return size


def _bytes_of(number: str, exp: str | None, unit: int) -> Fraction:
    """``number`` x 10^``exp`` ``unit``s, exactly (MAX_SIZE + 1 for a number far beyond it)."""
    whole, _, fraction = number.partition(".")
    if len(whole.lstrip("0")) > 20:
        return Fraction(MAX_SIZE + 1)
    value = Fraction(f"{whole or 0}.{fraction or 0}")
    power = max(-_MAX_EXP, min(_MAX_EXP, int(exp or 0)))
    return value * Fraction(10) ** power * unit


def fmt_bytes(n: int) -> str:
    """Bytes for a person: GiB, MiB or KiB; below 1 KiB the bytes themselves
    (``1 byte``, ``512 bytes``), not a rounded ``0 KiB``."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.0f} MiB"
    if abs(n) >= KiB:
        return f"{n / KiB:.0f} KiB"
    return f"{n} byte" if abs(n) == 1 else f"{n} bytes"


def fmt_bytes_down(n: int) -> str:
    """Bytes for a person as :func:`fmt_bytes` writes them, but never rounded up: a
    whole MiB or KiB as is (``90 MiB``), else two decimals rounded down (``89.99 MiB``,
    ``4.99 GiB``), so a refused size never reads as the least one taken."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if abs(n) >= unit:
            if unit != GiB and n % unit == 0:
                return f"{n // unit} {name}"
            hundredths = n * 100 // unit
            return f"{hundredths // 100}.{hundredths % 100:02d} {name}"
    return fmt_bytes(n)


def count_of(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count_of(1, "request")`` is
    ``"1 request"``, ``count_of(2_000, "page")`` ``"2,000 pages"``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
