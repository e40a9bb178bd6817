"""Memory sizes between bytes and text (engine/common/units.py): the one parser every
size option, the plan and the control API read, and sizes written for a person."""

from __future__ import annotations

import pytest

from engine.common.units import fmt_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GiB", 6 << 30),
        ("5.5GiB", int(5.5 * (1 << 30))),
        ("512MiB", 512 << 20),
        ("512 mib", 512 << 20),
        ("6GB", 6 * 10**9),
        ("64KiB", 64 << 10),
        ("2G", 2 << 30),
        ("1048576", 1 << 20),
        ("1PiB", 1 << 50), ("0.5 pib", 1 << 49),  # the largest size, in the unit its refusal names
        ("0", 0), (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "6 gibs", "-1GiB", "1.2.3GB", "six", True, -5, "1025TiB", "2PiB", "1.1PiB", 1 << 51,
                                  "9" * 5000, "\uff11GiB", "\u0661GiB", "1\uff0e5GiB", "1EiB", "0.5E", "2EB"])
def test_parse_size_refuses_non_sizes(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_parse_size_names_why_a_size_is_refused():
    """An exbibyte is a size beyond any machine (it was "not a size" while 30 digits of
    bytes were "more than 1 PiB"); text that is no size names the units taken and that
    digits are ASCII (a full-width "\uff11GiB" was read as 1 GiB)."""
    for text in ("1EiB", "3E", "1" * 30):
        with pytest.raises(ValueError, match=r"is more than 1 PiB, beyond any machine's memory"):
            parse_size(text)
    with pytest.raises(ValueError, match=r"'\uff11GiB' is not a size; .*ASCII digits, then B, K/KiB, .*E/EiB"):
        parse_size("\uff11GiB")


def test_fmt_bytes_below_a_kib_counts_bytes():
    assert [fmt_bytes(n) for n in (0, 1, 1000, 1536, 3 << 20)] == ["0 bytes", "1 byte", "1000 bytes", "2 KiB", "3 MiB"]
