"""Memory sizes between bytes and text (engine/common/units.py): the one parser every
size option, the plan and the control API read, and sizes written for a person."""

from __future__ import annotations

import pytest

from engine.common.clip import clip
from engine.common.units import GiB, MiB, fmt_bytes, fmt_bytes_down, parse_size


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


@pytest.mark.parametrize(("text", "expected"), [("1e9", 10**9), (1e9, 10**9), ("1.5e3", 1500), (5.0, 5), ("1.5KiB", 1536),
                                                ("0.1KiB", 102)])
def test_parse_size_reads_a_whole_float_as_bytes_from_text_or_a_number(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1.5", 1.5, "5.5B", "1e-3", ".5"])
def test_parse_size_refuses_a_fraction_of_a_byte_naming_the_units(text):
    with pytest.raises(ValueError, match=r"is not a whole number of bytes: write .*GiB"):
        parse_size(text)


def test_parse_size_refuses_a_bare_number_too_small_to_be_meant():
    for text in ("2", 2, 2.0, "1048575"):
        with pytest.raises(ValueError, match=r"without a unit is .*; did you mean .*GiB\? \(write .*B for bytes\)"):
            parse_size(text, unitless_min=1 << 20)
    assert [parse_size(t, unitless_min=1 << 20) for t in ("0", 0, "2B", "2KiB", "1048576")] == [0, 0, 2, 2048, 1 << 20]


def test_parse_size_and_its_refusals_echo_at_most_200_characters():
    for text in ("9x" * 100_000, "9" * 100_000):
        with pytest.raises(ValueError) as refused:
            parse_size(text)
        assert len(str(refused.value)) < 600 and "(" in str(refused.value), str(refused.value)[:1000]
    assert clip("a" * 200) == "a" * 200 and clip("a" * 201) == "a" * 200 + "... (201 characters)"


def test_fmt_bytes_down_never_reads_as_the_size_above():
    assert [fmt_bytes_down(n) for n in (90 * MiB - 1, 90 * MiB, 5 * GiB - 1, 1536, 1000)] == [
        "89.99 MiB", "90 MiB", "4.99 GiB", "1.50 KiB", "1000 bytes"]


def test_counts_are_plural_unless_one():
    from engine.common.units import count_of

    assert [count_of(n, "request") for n in (0, 1, 2, 2000)] == ["0 requests", "1 request", "2 requests",
                                                                  "2,000 requests"]
