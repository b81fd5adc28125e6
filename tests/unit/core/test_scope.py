"""The per-block scope record: typed fields, owned slots, nothing left in the caller's context."""

from __future__ import annotations

import ast
import contextvars
from pathlib import Path

import attrs
import torch
from torch import nn

import accel
from accel.core import scope as _scope
from accel.core.scope import Scope, ScopeSlot, scope
from accel.training.accumulation import accumulation_step, set_accumulation_step
from tests.conftest import _CONTEXT_VARS

ACCEL = Path(accel.__file__).parent


def test_scope_has_no_string_keyed_grab_bag() -> None:
    names = {f.name for f in attrs.fields(Scope)}
    assert "extras" not in names
    assert {"accumulation_step", "optimizers", "even_batches_override"} <= names


def test_every_accel_context_var_is_checked_by_the_leak_guard() -> None:
    guarded = {id(var) for var, _ in _CONTEXT_VARS.values()}
    found = []
    for path in ACCEL.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                ("ContextVar", "ContextSlot")
            ):
                found.append((path.relative_to(ACCEL).as_posix(), node.lineno))
    # the ContextVar holding every ContextSlot is checked slot by slot
    assert len(found) - 1 == len(guarded), (
        f"ContextVars and ContextSlots defined in accel {found} vs {len(guarded)} checked in "
        "tests/conftest.py: add the new one to _CONTEXT_VARS"
    )
    for var, outside in _CONTEXT_VARS.values():
        assert isinstance(var, contextvars.ContextVar | _scope.ContextSlot)
        assert outside is None


def test_a_context_slot_is_per_context_and_restores_only_its_own_value() -> None:
    first: _scope.ContextSlot[str] = _scope.ContextSlot("test first")
    second: _scope.ContextSlot[str] = _scope.ContextSlot("test second")
    before_first = first.set("a")
    before_second = second.set("b")
    seen_elsewhere = contextvars.Context().run(first.get)  # a fresh context sees nothing
    copied = contextvars.copy_context().run(lambda: (first.get(), second.get()))
    first.set(before_first)  # out of order: the other slot keeps its value
    assert (seen_elsewhere, copied, first.get(), second.get()) == (None, ("a", "b"), None, "b")
    second.set(before_second)
    assert second.get() is None


def test_trigger_outside_a_block_leaves_no_scope_in_the_context() -> None:
    accel.set_trigger()
    assert _scope._SCOPE.get(None) is None
    assert accel.check_trigger()  # the detached record kept it for this process
    assert not accel.check_trigger()  # check_trigger resets it
    assert _scope._SCOPE.get(None) is None


def test_block_scope_is_separate_from_the_detached_one() -> None:
    outside = scope()
    with accel.distributed(cpu=True):
        inside = scope()
        assert inside is not outside
        with accel.distributed(mixed_precision="no"):
            assert scope() is inside  # nested blocks share the outermost record
    assert scope() is outside


def test_nested_block_records_its_seed() -> None:
    with accel.distributed(cpu=True, seed=1):
        assert accel.state().seed == 1
        with accel.distributed(seed=7):
            assert accel.state().seed == 7
            first = torch.rand(3)
        torch.manual_seed(7)
        assert torch.equal(first, torch.rand(3))
        assert accel.state().seed == 1


def test_scope_slot_is_per_record_and_typed() -> None:
    slot: ScopeSlot[list[int]] = ScopeSlot("test slot")
    a, b = Scope(), Scope()
    assert slot.get(a) is None
    made = slot.get_or_create(list, a)
    made.append(1)
    assert slot.get_or_create(list, a) == [1]
    assert slot.get(b) is None
    slot.set([2], b)
    assert slot.pop(b) == [2]
    assert slot.pop(b) is None
    assert "test slot" in repr(slot)


def test_accumulation_step_accessors() -> None:
    model = nn.Linear(2, 2)
    with accel.distributed(cpu=True, gradient_accumulation_steps=3):
        assert accumulation_step(model) is None
        assert accumulation_step() is None
        with accel.accumulate(model) as sync:
            assert not sync
        assert accumulation_step(model) == 1
        with accel.accumulate() as sync:
            assert not sync
        assert accumulation_step() == 1
        set_accumulation_step(2, model)
        with accel.accumulate(model) as sync:
            assert sync  # the third batch of the cycle
        assert accumulation_step(model) == 0
        set_accumulation_step(2)
        with accel.accumulate() as sync:
            assert sync
        assert accumulation_step() == 0


def test_object_counts_keep_a_count_per_live_object() -> None:
    from accel.core.scope import ObjectCounts

    class Thing:
        pass

    counts, a, b = ObjectCounts(), Thing(), Thing()
    assert counts.get(a) is None and counts.get(a, 0) == 0
    counts.set(a, 2)
    counts.set(b, 1)
    counts.set(a, 3)
    assert (counts.get(a), counts.get(b), len(counts)) == (3, 1, 2)
    assert "_accel" not in str(vars(a))  # nothing written on the object
    del a
    assert len(counts) == 1  # the entry went with its object
    c = Thing()
    assert counts.get(c) is None  # a new object (even one reusing an id) starts from nothing
