"""JSON read as untrusted input: nesting measured without recursion, no key twice, no ``NaN``.

The one parser of hostile JSON text: accel's checkpoint files and weight indexes
(``accel._files.safe_io.load_json``) and DeepSpeed configs (``accel.core.config_file``) go
through :func:`parse_json`, each with its own bound and error; :func:`json_depth` measures the
nesting of a text before ``json`` recurses into it.

Example:
    >>> parse_json(b'{"a": 1}', ValueError, max_depth=64)
    {'a': 1}
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from accel.errors import AccelError

__all__ = ["json_depth", "parse_json"]

_CHUNK = 8 << 20  # bytes per slice of the nesting scan
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string literal
_NOT_MARK = bytes(b for b in range(256) if b not in b'[]{}"')


def json_depth(data: bytes, limit: int | None = None) -> int:
    """How deeply the arrays and objects of the JSON text ``data`` nest (brackets inside
    strings do not count), found without recursion; counting stops once past ``limit``
    (``None``: the whole text is measured).

    Example:
        >>> json_depth(b'{"a": [[1], "]]]"]}')
        3
    """
    import numpy as np

    if b"\\" in data:  # escapes (only valid inside strings) may hide quotes: drop strings
        data = _STRING.sub(b'""', data)
    marks = data.translate(None, _NOT_MARK)  # only [ ] { } and quotes are left
    deepest, level, quoted = 0, 0, 0
    for start in range(0, len(marks), _CHUNK):
        codes = np.frombuffer(marks, dtype=np.uint8, count=min(_CHUNK, len(marks) - start),
                              offset=start)
        quote = codes == 0x22
        inside = (np.cumsum(quote, dtype=np.uint8) + quoted) & 1  # parity wraps safely
        # '[' 0x5b and '{' 0x7b have bit 1 set, ']' 0x5d and '}' 0x7d do not: +1 / -1
        step = ((codes & 2).view(np.int8) - 1) * ~(quote | (inside == 1))
        levels = np.cumsum(step, dtype=np.int32) + level  # bounded by the text's length
        deepest = max(deepest, int(levels.max()))
        level, quoted = int(levels[-1]), int(inside[-1])
        if limit is not None and deepest > limit:
            break
    return deepest


def parse_json(
    data: bytes, error: Callable[[str], AccelError], *, max_depth: int,
    depth_note: str = "", constant_note: str = "",
) -> Any:
    """Parse the UTF-8 JSON ``data``; every refusal is ``error(what was wrong)``.

    Refused: nesting deeper than ``max_depth`` (measured first, without recursion), a key
    twice in one object, ``NaN`` / ``Infinity`` or a number too large for a float, text that
    is not UTF-8 JSON.

    Args:
        data: the text's bytes.
        error: makes the exception raised for a refusal (an accel error), given what was
            wrong.
        max_depth: the deepest nesting of arrays and objects allowed.
        depth_note: said after the nesting refusal (e.g. what the caller writes itself).
        constant_note: said after the ``NaN`` refusal.

    Example:
        >>> parse_json(b'{"a": 1, "a": 2}', ConfigError, max_depth=8)
        Traceback (most recent call last):
        ConfigError: an object holds the key 'a' twice
    """
    # fewer brackets than the bound cannot nest deeper than it: no scan (most texts)
    few = data.count(b"[") + data.count(b"{") <= max_depth
    depth = 0 if few else json_depth(data, max_depth)
    if depth > max_depth:
        raise error(
            f"its arrays and objects nest more than {max_depth} levels deep "
            f"(at least {depth}){depth_note}"
        )

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        table = dict(items)
        if len(table) != len(items):
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    raise error(f"an object holds the key {key!r:.80} twice")
                seen.add(key)
        return table

    def constant(name: str) -> float:
        raise error(f"it holds {name}, which is not JSON{constant_note}")

    def number(text: str) -> float:
        value = float(text)
        if value in (float("inf"), float("-inf")):
            raise error(f"the number {text:.40} is too large for a float")
        return value

    try:
        # decoded here: json.loads would also take UTF-16/32, which the byte scan above
        # cannot measure
        text = data.decode("utf-8")
        return json.loads(
            text, object_pairs_hook=pairs, parse_constant=constant, parse_float=number
        )
    except AccelError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"it is not valid UTF-8 JSON ({exc})") from None
