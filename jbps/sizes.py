"""Byte sizes as people write them: 4194304, 64K, 4M, 4MiB, "4 MiB", 1G;
and link rates: 1G, 200M, 2.5Gbit/s (bits per second, decimal, as NICs are sold).

K, M, G and T of sizes are binary (KiB, MiB, GiB, TiB), as everywhere in jbps.
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


def parse_rate(text: str) -> float:
    """Bits per second from '1G', '200M', '1gbit', '200mbit', '2.5Gbit/s' or a bare
    number of Mbit/s ('200'); ValueError saying the accepted form otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:bit|b)?(?:/s|ps)?\s*", str(text))
    if not m:
        raise ValueError(f"rate {text!r} is not a number of bits per second like 1G, 200M, 1gbit or 200 (Mbit/s)")
    value = float(m.group(1)) * {"": 1e6, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if not value >= 1e5:
        raise ValueError(f"rate {text!r} is below 100 kbit/s")
    return value


def format_rate(bits_per_s: float) -> str:
    if bits_per_s >= 1e9 and bits_per_s % 1e8 == 0:
        return f"{bits_per_s / 1e9:g} Gbit/s"
    return f"{bits_per_s / 1e6:g} Mbit/s"
