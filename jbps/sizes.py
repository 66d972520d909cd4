"""Byte sizes as people write them: 4194304, 64K, 4M, 4MiB, "4 MiB", 1G.

K, M, G and T are binary (KiB, MiB, GiB, TiB), as everywhere in jbps.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
FORM = "a number of bytes (4194304) or one with a binary unit: 64K, 4M, 1G (also 4MiB, 4 MiB)"
_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'4M' -> 4194304; ValueError saying the accepted form otherwise."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size: write {FORM}")
    return int(match.group(1)) * UNITS[match.group(2).upper()]


def format_bytes(nbytes: int) -> str:
    """4194304 -> '4 MiB': the largest unit that divides it."""
    for unit in ("T", "G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"
