"""Sizes and counts as people write and read them: byte sizes ("80GiB"), whole-number flags and
byte counts printed with their unit. Pure; imported by every command-line front end."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """An argparse type: a byte size such as 80GiB, 40GB or 1073741824."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 80GiB, 40GB or 1073741824")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a world size, a TP or PP size, a divisor)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def human(n: float) -> str:
    """Bytes with a binary unit: 512 B, 1.50 KiB, 80.00 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
