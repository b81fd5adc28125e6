"""CRC32 in pieces: checksum parts of a file in parallel threads, then combine them.

``zlib.crc32`` releases the GIL, so the parts of a large file can be checked by several
threads at once; :func:`crc32_combine` (zlib's algorithm, with the shift operators for
``2**k`` zero bytes computed once) joins the parts' CRCs into the CRC of the whole, which is
what the manifest records.

:func:`crc32` is ``zlib.crc32`` or, where the optional ``isal`` package is installed, its
``isal_zlib.crc32``: the same checksum (same polynomial, same values, so every checkpoint
reads alike either way), computed with the CPU's carry-less multiply, about 5x faster than
zlib's on this project's machines; both release the GIL.
"""

from __future__ import annotations

import functools
import importlib
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

__all__ = ["FAST", "crc32", "crc32_combine", "crc32_parallel", "join_crcs"]


def _pick() -> tuple[Callable[..., int], bool]:
    try:  # the optional extra accel[fast-checksum]
        fast: Callable[..., int] = importlib.import_module("isal.isal_zlib").crc32
    except (ImportError, AttributeError):  # zlib's is the same checksum, only slower
        return zlib.crc32, False
    probe = b"accel checkpoint crc32 probe"
    if fast(probe) != zlib.crc32(probe) or fast(probe[5:], fast(probe[:5])) != zlib.crc32(probe):
        return zlib.crc32, False  # never trust a checksum that disagrees with zlib's
    return fast, True


_CRC32, FAST = _pick()


def crc32(data: Any, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, from ``isal`` when it is installed (same values).

    Example:
        >>> crc32(b"abc") == zlib.crc32(b"abc")
        True
    """
    return _CRC32(data, value)

_POLY = 0xEDB88320
_PART = 32 << 20  # bytes per thread task when checking a buffer in parallel


def _times(matrix: Sequence[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _square(matrix: Sequence[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


@functools.cache
def _byte_shifts() -> tuple[tuple[int, ...], ...]:
    """Operators advancing a CRC over ``2**k`` zero bytes, for k = 0 .. 63."""
    one_bit = [_POLY] + [1 << n for n in range(31)]
    two_bits = _square(one_bit)
    four_bits = _square(two_bits)
    shift = _square(four_bits)  # one byte
    shifts = [tuple(shift)]
    for _ in range(63):
        shift = _square(shift)
        shifts.append(tuple(shift))
    return tuple(shifts)


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """CRC32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``.

    Example:
        >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
        True
    """
    if length2 <= 0:
        return crc1
    shifts = _byte_shifts()
    k = 0
    while length2:
        if length2 & 1:
            crc1 = _times(shifts[k], crc1)
        length2 >>= 1
        k += 1
    return crc1 ^ crc2


def join_crcs(parts: Sequence[tuple[int, int]]) -> int:
    """The CRC32 of consecutive parts given as ``(length, crc)`` in order.

    Example:
        >>> join_crcs([(2, zlib.crc32(b"ab")), (1, zlib.crc32(b"c"))]) == zlib.crc32(b"abc")
        True
    """
    crc = 0
    for length, part in parts:
        crc = crc32_combine(crc, part, length)
    return crc


def crc32_parallel(data: memoryview, pool: Executor | None) -> int:
    """CRC32 of ``data``, its parts checked on ``pool``'s threads when it is large.

    Example:
        >>> crc32_parallel(memoryview(b"abc"), None) == zlib.crc32(b"abc")
        True
    """
    if pool is None or len(data) <= _PART:
        return _CRC32(data)
    starts = range(0, len(data), _PART)
    crcs = list(pool.map(lambda s: _CRC32(data[s : s + _PART]), starts))
    return join_crcs([(min(_PART, len(data) - s), c) for s, c in zip(starts, crcs, strict=True)])
