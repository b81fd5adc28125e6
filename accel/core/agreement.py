"""Ranks agree on their settings, once per call, before any engine starts.

``distributed()`` and the prepare calls (``prepare_model``, ``prepare``, DeepSpeed's
``initialize`` after its ``"auto"`` filling) reduce what this rank resolved to a canonical
JSON text (:func:`describe`), hash it, and make ONE small collective: an ``all_gather`` of a
fixed-size tensor (the 32-byte SHA-256 and the text's length). Only when the hashes differ is
there a second exchange, of the texts themselves, so that every rank can name each key that
differs and each rank's value; every rank then raises the same
:class:`~accel.errors.ConfigError`. Nothing is exchanged per step.

Values that are not plain data are described by a stable text: callables, classes and modules
by their qualified name, enums by ``Class.MEMBER``, dataclass and attrs instances by their type
and fields, any other object by its type's qualified name only (its contents are not compared).

The exchange uses ``torch.distributed`` directly (core never imports ``accel.comm``). It is
skipped on one process and inside a rank-gated region (where not every rank runs the code).

Example:
    >>> agree_on_settings("accel.prepare_model()", {"pp_schedule": "1F1B"}, device=cpu)
    # rank 1 passed "GPipe": every rank raises
    ConfigError: accel.prepare_model(): ranks disagree on pp_schedule: rank 0 '1F1B', rank 1 ...
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch
import torch.distributed as dist

from accel.core.arrival import check_arrival
from accel.core.scope import ScopeSlot
from accel.core.state import ProcessState, current_gate, state
from accel.errors import ConfigError

__all__ = ["agree_on_settings", "agreed_once", "describe", "disagreement", "settings_of"]

_DEPTH = 12  # nesting described; deeper is one text
_SHOWN_KEYS = 12  # differing keys named in the message; more are counted
_SHOWN_VALUES = 8  # distinct values named per key
_VALUE_CHARS = 200
_ABSENT = object()  # a key one rank does not have
_SETTLED: ScopeSlot[str] = ScopeSlot("accel.core.agreement call agreed")
"""The enclosing call that agreed already (``accel.prepare()``), while it runs."""


def _qualified(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name is None:
        kind = type(obj)
        return f"<{kind.__module__}.{kind.__qualname__} object>"
    return f"{module}.{name}" if module else str(name)


def describe(value: object, depth: int = 0) -> Any:
    """``value`` as plain JSON data that is the same on every rank for the same setting.

    Plain values (str, int, float, bool, None) are kept; lists, tuples and sets become lists
    (sets sorted), mappings dicts with text keys; enums ``"Class.MEMBER"``; dataclass and
    attrs instances ``{"type": name, field: value...}``; callables, classes and modules their
    qualified name; ``torch.dtype``/``torch.device`` and paths their text; anything else its
    type's qualified name (``"<module.Type object>"``: contents not compared).

    Example:
        >>> describe({"plan": ("layers.1",), "hook": print, "dtype": torch.bfloat16})
        {'plan': ['layers.1'], 'hook': 'builtins.print', 'dtype': 'torch.bfloat16'}
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if depth >= _DEPTH:
        return f"<{type(value).__qualname__} nested deeper than {_DEPTH}>"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, os.PathLike):
        return str(os.fspath(value))
    if isinstance(value, Mapping):
        return {str(describe(k, depth + 1)): describe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [describe(v, depth + 1) for v in value]
    if isinstance(value, set | frozenset):
        items = [describe(v, depth + 1) for v in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True, default=str))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
        return {"type": _qualified(type(value)), **describe(fields, depth + 1)}
    if attrs.has(type(value)):
        kind: Any = type(value)
        fields = {f.name: getattr(value, f.name, None) for f in attrs.fields(kind)}
        return {"type": _qualified(type(value)), **describe(fields, depth + 1)}
    if callable(value) or isinstance(value, types.ModuleType):
        return _qualified(value)
    return f"<{type(value).__module__}.{type(value).__qualname__} object>"


def settings_of(st: ProcessState) -> dict[str, Any]:
    """The run-wide settings of ``st`` every rank must share: mixed precision, accumulation,
    strategy, debug, ``on_each_node``, the mesh sizes, the cp method and every option (DDP,
    FSDP, DeepSpeed, fp8, activation checkpointing), described (:func:`describe`).

    The rank's own facts (rank, device), the seed and the timeout are not compared.

    Example:
        >>> settings_of(accel.state())["strategy"]
        'none'
    """
    shape = st.mesh_shape
    described: dict[str, Any] = describe({
        "mixed_precision": st.mixed_precision,
        "gradient_accumulation_steps": st.gradient_accumulation_steps,
        "strategy": st.strategy,
        "debug": st.debug,
        "on_each_node": st.on_each_node,
        "mesh (pp, dp_replicate, dp_shard, cp, tp)": None if shape is None else list(shape),
        "cp_method": st.cp_method,
        **dict(st.options),
    })
    return described


def _canonical(values: Mapping[str, Any]) -> bytes:
    text = json.dumps(describe(values), sort_keys=True, separators=(",", ":"), default=str)
    return text.encode("utf-8")


def _digest(data: bytes, device: torch.device) -> torch.Tensor:
    words = torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.int64)
    return torch.cat([words, torch.tensor([len(data)], dtype=torch.int64)]).to(device)


def _exchange_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def agree_on_settings(
    call: str, values: Mapping[str, Any], *, device: torch.device, st: ProcessState | None = None
) -> None:
    """Raise on every rank when the ranks resolved different ``values`` for ``call``.

    A collective: every rank must call it, in the same order as its other collectives. One
    ``all_gather`` of 5 int64 per rank; a second (the JSON texts, padded to the longest) only
    when they differ. Skipped on one process, inside a rank-gated region, and inside
    :func:`agreed_once` (the enclosing call agreed already).

    Args:
        call: what is being agreed on, as the user wrote it (``"accel.prepare_model()"``).
        values: setting name -> value (described by :func:`describe`).
        device: this rank's device (the exchange runs there under nccl, else on the CPU).
        st: the state whose ``arrival_timeout`` bounds the wait for the other ranks (default
            ``accel.state()``; ``distributed()`` passes the block's before it is set).

    Raises:
        ConfigError: the ranks differ; names each key that differs and each rank's value.

    Example:
        >>> agree_on_settings("accel.prepare_model()", {"microbatches": 4}, device=st.device)
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    if current_gate() is not None or _SETTLED.get() is not None:
        return
    # a rank that never makes the call (it sits in `if is_main_process:`) is named within
    # arrival_timeout instead of leaving the others in the all_gather
    check_arrival(state() if st is None else st, call.removeprefix("accel.").split("(")[0],
                  "arrival_timeout")
    data = _canonical(values)
    where = _exchange_device(device)
    world = dist.get_world_size()
    mine = _digest(data, where)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    rows = [g.cpu() for g in gathered]
    if all(torch.equal(row, rows[0]) for row in rows[1:]):
        return
    longest = max(int(row[-1]) for row in rows)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    texts = [torch.empty(longest, dtype=torch.uint8, device=where) for _ in range(world)]
    dist.all_gather(texts, padded.to(where))
    seen = [
        json.loads(bytes(t.cpu().tolist()[: int(row[-1])]).decode("utf-8"))
        for t, row in zip(texts, rows, strict=True)
    ]
    message = disagreement(call, seen)
    if message is not None:
        raise ConfigError(message)


@contextmanager
def agreed_once(call: str, values: Mapping[str, Any], *, device: torch.device) -> Iterator[None]:
    """Agree on ``values`` (:func:`agree_on_settings`), then run the block without further
    agreements: the calls it makes (``prepare`` calling ``prepare_model``) were covered.

    A collective: every rank must enter it.

    Example:
        >>> with agreed_once("accel.prepare()", {"objects": ["Net", "AdamW"]}, device=dev):
        ...     model = accel.prepare_model(net)   # no second exchange
    """
    agree_on_settings(call, values, device=device)
    outer = _SETTLED.get()
    _SETTLED.set(call)
    try:
        yield
    finally:
        if outer is None:
            _SETTLED.pop()
        else:
            _SETTLED.set(outer)


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def _ranks(ranks: Sequence[int]) -> str:
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def _shown(value: Any) -> str:
    text = "<not set>" if value is _ABSENT else repr(value)
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "..."



def disagreement(call: str, seen: Sequence[Mapping[str, Any]]) -> str | None:
    """The error message for every rank's settings ``seen`` (rank order), or ``None`` when
    they agree. Nested mappings are compared key by key (``zero_optimization.stage``).

    Example:
        >>> disagreement("accel.prepare_model()", [{"pp_schedule": "1F1B"},
        ...                                        {"pp_schedule": "GPipe"}])
        "accel.prepare_model(): ranks disagree on pp_schedule: rank 0 '1F1B', rank 1 'GPipe'. ..."
    """
    flat = [_flat(values) for values in seen]
    keys = list(dict.fromkeys(key for values in flat for key in values))
    parts: list[str] = []
    first: tuple[str, Any] | None = None
    for key in keys:
        by_value: dict[str, tuple[Any, list[int]]] = {}
        for rank, values in enumerate(flat):
            value = values.get(key, _ABSENT)
            text = _shown(value)
            by_value.setdefault(text, (value, []))[1].append(rank)
        if len(by_value) < 2:
            continue
        if first is None:
            first = (key, next(iter(by_value.values()))[0])
        shown = [f"{_ranks(ranks)} {text}" for text, (_, ranks) in by_value.items()]
        if len(shown) > _SHOWN_VALUES:
            shown = [*shown[:_SHOWN_VALUES], f"{len(shown) - _SHOWN_VALUES} more values"]
        parts.append(f"{key}: {', '.join(shown)}")
    if first is None:
        return None
    if len(parts) > _SHOWN_KEYS:
        parts = [*parts[:_SHOWN_KEYS], f"and {len(parts) - _SHOWN_KEYS} more keys"]
    key, value = first
    example = f"{key} = {_shown(value)}"
    return (
        f"{call}: ranks disagree on " + "; on ".join(parts) + ". Every rank must resolve the "
        "same settings (arguments, `accel launch` flags, ACCEL_* variables, config file), or "
        f"the engines wait on each other or train different models; {call} stopped before "
        f"starting anything. Give every rank the same values, e.g. `{example}` on all of them "
        "(not one computed from the rank or read from a per-machine file)."
    )
