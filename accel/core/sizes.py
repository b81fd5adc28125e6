"""Byte sizes written by people: ``1_000_000``, ``"200MB"``, ``"10GiB"``."""

from __future__ import annotations

import re

from accel.errors import CheckpointError

__all__ = ["UNITS", "parse_shard_size", "parse_size"]

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(size: object) -> int | None:
    """``size`` in bytes, or ``None`` when it is not a size (the caller raises its own error).

    Accepts a non-negative int, or a string: a number then a unit among B, KB, MB, GB, TB
    (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), case-insensitive.

    Example:
        >>> parse_size("200MB"), parse_size("1GiB"), parse_size(5), parse_size("big")
        (200000000, 1073741824, 5, None)
    """
    if isinstance(size, bool):
        return None
    if isinstance(size, int):
        return size if size >= 0 else None
    if not isinstance(size, str):
        return None
    match = _SIZE.fullmatch(size)
    if match is None or match.group(2).upper() not in UNITS:
        return None
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def parse_shard_size(value: object, *, example: str) -> int:
    """``max_shard_size`` in bytes: a size over zero, as :func:`parse_size` reads it.

    Args:
        value: The ``max_shard_size`` the user gave (bytes, or a string such as ``"5GB"``).
        example: The first size the error message suggests (each caller names its default).

    Returns:
        The size in bytes, at least 1.

    Raises:
        CheckpointError: ``value`` is not a size, or is zero.

    Example:
        >>> parse_shard_size("2GiB", example="10GB")
        2147483648
    """
    size = parse_size(value)
    if size is None or size <= 0:
        raise CheckpointError(
            f"max_shard_size={value!r} is not a size; give bytes or a string such as "
            f"{example!r}, '500MB' or '2GiB'."
        )
    return size
