"""Dotted version numbers compared as numbers (``535.183.01``, ``11.8``, ``3.2.0``).

The driver's, CUDA's and a package's public version all order this way; what
follows the numbers (``+cu118``, ``-1~deb12u1``) is not part of the order.
"""

from __future__ import annotations

import re


def version_tuple(version: object) -> tuple[int, ...]:
    """``"535.183.01"`` -> ``(535, 183, 1)``; ``()`` when it does not start with a number."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def compare_versions(a: object, b: object) -> int:
    """-1, 0 or 1 as ``a`` is older than, the same as or newer than ``b`` (1.0 == 1.0.0)."""
    ta, tb = version_tuple(a), version_tuple(b)
    n = max(len(ta), len(tb))
    ta, tb = ta + (0,) * (n - len(ta)), tb + (0,) * (n - len(tb))
    return (ta > tb) - (ta < tb)
