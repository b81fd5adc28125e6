"""Say a thing once per block: the keys of the notes and warnings already given, in the Scope.

A note that must not repeat on every step or for every model (options that do not apply, a
model left whole, a cache argument dropped) asks :func:`first_time` with a key of its own
before it speaks. The keys said are kept in the :class:`~accel.core.scope.Scope` of the
outermost ``distributed()`` block, never in a module-level flag: nested blocks share the
outer block's keys, and each new outermost block says everything once more. Outside any block
the detached record serves the whole process, so there a note is said once per process.
"""

from __future__ import annotations

from collections.abc import Hashable

from accel.core.scope import ScopeSlot

__all__ = ["first_time"]

_SAID: ScopeSlot[set[Hashable]] = ScopeSlot("accel.core.once keys said")


def first_time(key: Hashable) -> bool:
    """Whether ``key`` is asked for the first time in this block (it is then marked said).

    Args:
        key: what is said, unique to its module: ``(__name__, "what")``, with the subject
            when it is said once per subject (``(__name__, "left whole", class_name)``).

    Returns:
        True the first time in the current scope, False afterwards.

    Example:
        >>> with accel.distributed():
        ...     first_time((__name__, "ignored")), first_time((__name__, "ignored"))
        (True, False)
    """
    said = _SAID.get_or_create(set)
    if key in said:
        return False
    said.add(key)
    return True
