r"""The block's mutable record: :class:`Scope`, in its own ContextVar beside the frozen state.

The outermost ``distributed()`` block makes one and its nested blocks share it; outside any
block one detached record serves the process. It holds what changes while the run goes on
(the sync flag, loaders being iterated, prepared optimizers, accumulation counts per model),
each module's private values in typed slots (:class:`ScopeSlot`), and the block's exit steps
(:func:`at_block_exit`), which ``distributed()`` runs when the block ends.

Values that belong to a context rather than to a block (a tracking run, which is active with
or without a ``distributed()`` block and per thread) live in :class:`ContextSlot`\ s, all held
in one ContextVar of this module: no feature keeps a ContextVar of its own.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import attrs

__all__ = [
    "ContextSlot",
    "ObjectCounts",
    "Scope",
    "ScopeSlot",
    "at_block_exit",
    "enter_scope",
    "leave_scope",
    "reset_detached_scope",
    "run_exit_steps",
    "scope",
]


class ObjectCounts:
    """A count per live object, kept beside the object, not on it: an entry goes when its
    object does (a weak reference's callback), and a new object that reuses a dead one's id
    starts from nothing.

    Cheaper per lookup than a ``WeakKeyDictionary`` (which makes a weak reference on every
    ``get`` and ``[]=``): ``accumulate()`` reads and writes one count per step.

    Example:
        >>> counts = ObjectCounts()
        >>> counts.set(model, 2)
        >>> counts.get(model), len(counts)
        (2, 1)
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, list[Any]] = {}  # id -> [weak reference, count]

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, obj: object, default: int | None = None) -> int | None:
        """The count of ``obj``, or ``default`` when it has none."""
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        count: int = entry[1]
        return count

    def advance(self, obj: object, modulo: int) -> int:
        """Add one to the count of ``obj`` (from 0 when it has none), modulo ``modulo``, and
        return it: one lookup, for the per-step caller."""
        entry = self._entries.get(id(obj))
        if entry is not None and entry[0]() is obj:
            count: int = (entry[1] + 1) % modulo
            entry[1] = count
            return count
        count = 1 % modulo
        self.set(obj, count)
        return count

    def set(self, obj: object, count: int) -> None:
        """Set the count of ``obj``."""
        key = id(obj)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is obj:
            entry[1] = count
            return
        entries = self._entries

        def forget(ref: weakref.ref[Any]) -> None:
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        entries[key] = [weakref.ref(obj, forget), count]


@attrs.define(eq=False)
class Scope:
    """Mutable per-``distributed()`` record: facts shared by the functions of one scope.

    Owned by the outermost ``distributed()`` block (shared by nested ones); outside any block,
    one detached record serves the process (see :func:`scope`). Facts read by several modules
    are typed fields here; a value private to one module lives in a :class:`ScopeSlot` that
    module owns.
    """

    created_group: bool = False
    trigger: bool = False
    collective_seq: int = 0
    # training path: whether the current step syncs gradients (accumulate() sets it; prepared
    # optimizers/schedulers read it), the prepared loaders being iterated (innermost last;
    # each has ``end_of_dataloader`` and ``remainder``), and the fp16 GradScaler if any.
    sync_gradients: bool = True
    active_loaders: list[Any] = attrs.field(factory=list)
    grad_scaler: Any = None
    # batches since the last sync step of accumulate(): per first model given (weakly keyed:
    # an entry goes with its model), and for accumulate() called without models (None: it
    # never ran); read through accel.training.accumulation.accumulation_step /
    # set_accumulation_step.
    model_steps: ObjectCounts = attrs.field(factory=lambda: ObjectCounts())
    accumulation_step: int | None = None
    # the prepared optimizers of this scope (for unscale_gradients() with no argument, ...).
    optimizers: list[weakref.ref[Any]] = attrs.field(factory=list)
    # the even_batches of the innermost join_uneven_inputs(..., even_batches=...) block, read
    # by loaders that start iterating inside it (None: each loader's own setting).
    even_batches_override: bool | None = None
    # what features must do when the block ends (finish an async save, restore signal
    # handlers, release DDP reducers): registered with at_block_exit, run by distributed().
    exit_steps: list[Callable[[bool], None]] = attrs.field(factory=list)
    _slots: dict[ScopeSlot[Any], Any] = attrs.field(factory=dict, alias="_slots")


T = TypeVar("T")


class ScopeSlot(Generic[T]):
    """A per-scope value private to the module that creates the slot (typed, no string keys).

    Example:
        >>> _WATCH: ScopeSlot[Watch] = ScopeSlot("accel.preemption watch")
        >>> watch = _WATCH.get_or_create(Watch)
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"ScopeSlot({self.name!r})"

    def get(self, record: Scope | None = None) -> T | None:
        """The value in ``record`` (default: the current scope), or ``None``."""
        found: T | None = (scope() if record is None else record)._slots.get(self)
        return found

    def get_or_create(self, factory: Callable[[], T], record: Scope | None = None) -> T:
        """The value, made with ``factory()`` and stored on first use."""
        slots = (scope() if record is None else record)._slots
        if self in slots:
            value: T = slots[self]
            return value
        created = slots[self] = factory()
        return created

    def set(self, value: T, record: Scope | None = None) -> None:
        """Store ``value`` for this slot."""
        (scope() if record is None else record)._slots[self] = value

    def pop(self, record: Scope | None = None) -> T | None:
        """Remove and return the value (``None`` when there was none)."""
        popped: T | None = (scope() if record is None else record)._slots.pop(self, None)
        return popped


_SCOPE: contextvars.ContextVar[Scope] = contextvars.ContextVar("accel_scope")

_CONTEXT: contextvars.ContextVar[Mapping[ContextSlot[Any], Any]] = contextvars.ContextVar(
    "accel_context_slots", default=MappingProxyType({})
)


class ContextSlot(Generic[T]):
    """A per-context value private to the module that creates the slot (typed, no string keys).

    Seen in the context that set it and in those copied from it (threads started with
    ``contextvars.copy_context()``, asyncio tasks), in and out of ``distributed()`` blocks;
    another thread's context does not see it. :meth:`set` returns the value it replaces, which
    the caller puts back with :meth:`set` when its block ends (each slot restores only its own
    value, whatever other slots did meanwhile).

    Example:
        >>> _RUN: ContextSlot[TrackingRun] = ContextSlot("accel.trackers run")
        >>> previous = _RUN.set(run)
        >>> try:
        ...     ...
        ... finally:
        ...     _RUN.set(previous)
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"ContextSlot({self.name!r})"

    def get(self) -> T | None:
        """The value in the current context, or ``None``."""
        found: T | None = _CONTEXT.get().get(self)
        return found

    def set(self, value: T | None) -> T | None:
        """Make ``value`` this slot's value in the current context; return the one before."""
        current = _CONTEXT.get()
        previous: T | None = current.get(self)
        _CONTEXT.set({**current, self: value})  # a new mapping: copied contexts keep theirs
        return previous


def enter_scope(record: Scope) -> contextvars.Token[Scope]:
    """Make ``record`` the scope of the current context (``set_state`` does it for a block)."""
    return _SCOPE.set(record)


def leave_scope(token: contextvars.Token[Scope]) -> None:
    """Restore the scope :func:`enter_scope` replaced."""
    _SCOPE.reset(token)


_DETACHED: list[Scope] = []  # the record used outside any block (made on first use)


def scope() -> Scope:
    """The scope record of the active ``distributed()`` block.

    Outside any block, one detached record serves the process: nothing is set in the caller's
    context (a ``set_trigger()`` there does not leave a ``Scope`` in the ContextVar).
    """
    current = _SCOPE.get(None)
    if current is not None:
        return current
    if not _DETACHED:
        _DETACHED.append(Scope())
    return _DETACHED[0]


def at_block_exit(step: Callable[[bool], None], record: Scope | None = None) -> None:
    """Run ``step(failed)`` when the ``distributed()`` block of ``record`` (default: the
    current scope) ends, once, however often it is registered.

    ``failed`` is True when an exception leaves the block: the step must then make no
    collective. Steps run last registered first, while the block's state is still set and
    before the process group it created is destroyed. Outside any block nothing runs them.

    Example:
        >>> at_block_exit(lambda failed: watch.finish(failed=failed))
    """
    steps = (scope() if record is None else record).exit_steps
    if step not in steps:
        steps.append(step)


def run_exit_steps(record: Scope, *, failed: bool) -> None:
    """Run the block's exit steps (last registered first); used by ``distributed()``.

    A step that raises makes the later ones run as after a failure; the first error is
    raised once every step has run.
    """
    error: BaseException | None = None
    while record.exit_steps:
        step = record.exit_steps.pop()
        try:
            step(failed or error is not None)
        except BaseException as exc:
            if error is None:
                error = exc
    if error is not None:
        raise error


def reset_detached_scope() -> None:
    """Forget the record used outside any block (for test isolation)."""
    _DETACHED.clear()
