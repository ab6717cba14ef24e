"""Quantities for people: byte counts in binary units."""

from __future__ import annotations

import re

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


#: size suffixes: MB/GB... are powers of 10, MiB/GiB... powers of 2 (a bare number is bytes)
SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``"20GiB"`` → 21474836480, ``"12000MB"`` → 12000000000, ``"512"`` → 512 (bytes).

    MB/GB/TB are 10⁶/10⁹/10¹² bytes, MiB/GiB/TiB binary (case does not matter). Raises ValueError
    with a sentence that says what is accepted."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit not in SIZE_UNITS and unit != ""):
        raise ValueError(
            f"{text!r} is not a size: write a number with a unit, e.g. '20GiB' or '12000MB' "
            "(MB/GB are 10^6/10^9 bytes, MiB/GiB 2^20/2^30)"
        )
    return int(float(match.group(1)) * SIZE_UNITS[unit or "b"])


def decimal_bytes(n: int) -> str:
    """``n`` bytes in decimal units for people, as budgets are written: "8.4 GB", "270 MB",
    "12 kB", "512 B"."""
    if n >= 10**9:
        return f"{n / 1e9:.1f} GB"
    if n >= 10**6:
        return f"{n / 1e6:.0f} MB"
    if n >= 10**3:
        return f"{n / 1e3:.0f} kB"
    return f"{n} B"
