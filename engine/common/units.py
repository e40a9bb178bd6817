"""Memory sizes between bytes and what a person reads or writes.

Torch-free: the service parses its options with :func:`parse_size`, the memory plan
prints its ledger with :func:`fmt_bytes`, and both read the one table below. Inside the
code every size is in bytes.
"""

from __future__ import annotations

import re

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

# ASCII only: ``\d`` and ``int()`` take any script's digits ("１GiB" would be 1 GiB).
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-zA-Z]*)\s*$", re.ASCII)


def parse_size(text: str | int) -> int:
    """A memory size in bytes from what a person writes.

    ``"6GiB"``, ``"5.5GiB"``, ``"512MiB"``, ``"64KiB"`` are binary (so are the bare
    ``K``/``M``/``G``/``T``/``P``); ``"6GB"``, ``"512MB"`` are decimal; ``"1048576"`` (or an
    int) is bytes. Case and a space before the unit do not matter. Fractions round down
    to whole bytes. Digits are ASCII ones only. Exbibytes (``EiB``, ``E``, ``EB``) are
    read, to be refused as more than :data:`MAX_SIZE`.

    Raises:
        ValueError: not a size (the message names the units taken), a negative one, or
            one above :data:`MAX_SIZE` (1 PiB); the message gives examples.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size; write {SIZE_EXAMPLES}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative; a size is at least 0 bytes")
        size = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group("unit").lower() if match else None
        if match is None or unit not in SIZE_UNITS:
            raise ValueError(f"{str(text)!r} is not a size; write {SIZE_EXAMPLES}: {SIZE_FORM}")
        # Whole digits and the unit in integers: a float would be inf past ~1e308.
        whole, _, fraction = match.group("number").partition(".")
        whole = whole.lstrip("0")
        size = MAX_SIZE + 1 if len(whole) > 20 else int(whole or 0) * SIZE_UNITS[unit]
        size += int(float(f"0.{fraction or 0}") * SIZE_UNITS[unit])
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} is more than 1 PiB, beyond any machine's memory; write a size, {SIZE_EXAMPLES}")
    return size


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
