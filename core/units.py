"""Quantities for people: byte counts in binary units."""

from __future__ import annotations

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: int, *, empty: str = "–", largest: str = "TiB") -> str:
    """``n`` bytes as "512 B", "1.5 MiB"... (one decimal from KiB up); ``empty`` when n <= 0.

    ``largest`` is the biggest unit used: larger counts stay in it ("2048.0 GiB").
    """
    if n <= 0:
        return empty
    units = BYTE_UNITS[: BYTE_UNITS.index(largest) + 1]
    value = float(n)
    step = 0
    while value >= 1024 and step < len(units) - 1:
        value /= 1024
        step += 1
    return f"{value:.0f} B" if step == 0 else f"{value:.1f} {units[step]}"
