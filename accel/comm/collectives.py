"""Collectives over nested tensors: every rank must call them, in the same order.

On a single process each returns its input unchanged (``gather_object`` returns ``[obj]``).
Inside a rank-gated function or block they raise :class:`GatedCollectiveError` at once
instead of hanging. With ``debug=True`` every call first checks that all ranks called the same
collective with matching shapes (see :mod:`accel.comm._debug`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from accel.comm._debug import check_signatures
from accel.core.arrival import ArrivalBound, check_arrival
from accel.core.scope import scope
from accel.core.state import ProcessState, current_gate, state
from accel.core.tree import first_non_tensor, map_tensors, tensor_leaves
from accel.errors import (
    CollectiveArgumentError,
    CollectiveMismatchError,
    CollectiveTypeError,
    GatedCollectiveError,
    NotDistributedError,
)

__all__ = [
    "broadcast",
    "broadcast_object",
    "check_trigger",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "set_trigger",
    "split_between_processes",
    "wait_for_everyone",
]

T = TypeVar("T")
Reduction = Literal["sum", "mean", "max", "min"]
_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _spec(data: Any, *, shapes: bool = True) -> list[str]:
    if shapes:
        return [f"{tuple(t.shape)}:{t.dtype}" for t in tensor_leaves(data)]
    return [f"ndim={t.ndim}:{t.dtype}" for t in tensor_leaves(data)]


def refuse_gated(op: str) -> None:
    """Raise :class:`GatedCollectiveError` if called inside a rank gate (on any world size)."""
    gate = current_gate()
    if gate is not None:
        raise GatedCollectiveError(
            f"accel.{op}() is a collective (every rank must call it) but was called inside "
            f"{gate}, which runs on only some ranks: the others would never join and the job "
            f"would hang. Call `accel.{op}()` outside the gated function or block, on every "
            "rank, and pass the result in."
        )


def begin(
    op: str, data: Any = None, *, shapes: bool = True, arrive: ArrivalBound | None = None
) -> ProcessState | None:
    """Common entry of every collective.

    Raises if called inside a gate or without a process group; with ``arrive`` (the calls
    every rank must make that are not per-step: ``save_state``, ``wait_for_everyone``...)
    waits for every rank's arrival, at most ``state().<arrive>`` seconds
    (:func:`~accel.core.arrival.check_arrival`); runs the debug check. Returns the state when
    communication is needed, ``None`` on a single process.
    """
    refuse_gated(op)
    st = state()
    if st.world_size == 1:
        return None
    if not dist.is_initialized():
        raise NotDistributedError(
            f"accel.{op}() needs the process group of this {st.world_size}-process job, but "
            "none is initialised. Run the code inside `with accel.distributed():` (it joins "
            "the group the launcher prepared)."
        )
    if arrive is not None:
        check_arrival(st, op, arrive)
    if st.debug:
        spec = [] if data is None else _spec(data, shapes=shapes)
        check_signatures(st, scope(), op, spec)
    return st


def _require_tensors(op: str, data: Any, hint: str) -> None:
    found = first_non_tensor(data)
    if found is not None:
        path, value = found
        where = f" at {path}" if path else ""
        raise CollectiveTypeError(
            f"accel.{op}() communicates tensors, but got {type(value).__name__} "
            f"{value!r:.80}{where}. {hint}"
        )


def _all_gather(world_size: int, tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()  # gathered values carry no autograd history
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    tensor = tensor.contiguous()
    out = tensor.new_empty((world_size * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(out, tensor)
    return out


def gather(data: T) -> T:
    """Gather tensors from every rank, concatenated on dim 0 in rank order.

    Every rank must call it, with tensors of the same shape (use
    :func:`pad_across_processes` first when sizes differ). A 0-d tensor becomes a 1-d tensor
    of ``world_size`` values. Nested lists, tuples and dicts keep their structure.

    Example:
        >>> accel.gather(torch.tensor([accel.state().rank]))
        tensor([0, 1])  # rank 0 and rank 1 alike
    """
    _require_tensors("gather", data, "Use `accel.gather_object()` for other Python objects.")
    st = begin("gather", data)
    if st is None:
        return data
    return map_tensors(partial(_all_gather, st.world_size), data)


def gather_object(obj: T) -> list[T]:
    """Gather a picklable object from every rank: a list with one entry per rank.

    Every rank must call it. The entries are not flattened.

    Example:
        >>> accel.gather_object({"rank": accel.state().rank})
        [{'rank': 0}, {'rank': 1}]  # rank 0 and rank 1 alike
    """
    st = begin("gather_object")
    if st is None:
        return [obj]
    out: list[Any] = [None] * st.world_size
    dist.all_gather_object(out, obj)
    return out


def _reduce_one(
    reduction: str, scale: float, world_size: int, tensor: torch.Tensor
) -> torch.Tensor:
    out = tensor.detach().clone().contiguous()
    dist.all_reduce(out, op=getattr(dist.ReduceOp, _REDUCE_OPS[reduction]))
    if reduction == "mean":
        out = out / world_size
    if scale != 1.0:
        out = out * scale
    return out


def reduce(data: T, reduction: Reduction = "sum", scale: float = 1.0) -> T:
    """Reduce tensors across ranks (``"sum"``, ``"mean"``, ``"max"`` or ``"min"``) times ``scale``.

    Every rank must call it; every rank gets the result. The input is left unchanged: new
    tensors are returned.

    Example:
        >>> accel.reduce(torch.tensor(float(accel.state().rank + 1)), "mean")
        tensor(1.5000)  # on 2 ranks, rank 0 and rank 1 alike
    """
    if not isinstance(reduction, str) or reduction not in _REDUCE_OPS:
        raise CollectiveArgumentError(
            f"reduction={reduction!r} is not supported; choose one of {list(_REDUCE_OPS)}, "
            "e.g. `accel.reduce(loss, 'mean')`."
        )
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise CollectiveTypeError(
            f"accel.reduce(scale={scale!r:.40}) needs a number, e.g. "
            "`accel.reduce(loss, 'sum', scale=0.5)`."
        )
    _require_tensors("reduce", data, "Reduce tensors, e.g. `torch.tensor(value)`.")
    st = begin("reduce", data)
    if st is None:
        if scale == 1.0:
            return data
        return map_tensors(lambda t: t * scale, data)
    fn = partial(_reduce_one, reduction, scale, st.world_size)
    return map_tensors(fn, data)


def _check_source(op: str, from_process: object, world_size: int) -> None:
    """Refuse a source rank that is not a rank of the job (on one process too)."""
    if (
        isinstance(from_process, bool)
        or not isinstance(from_process, int)
        or not 0 <= from_process < world_size
    ):
        raise CollectiveArgumentError(
            f"accel.{op}(from_process={from_process!r}) names no rank of this "
            f"{world_size}-process job; use an integer rank in 0..{world_size - 1}, "
            f"e.g. `accel.{op}(data, from_process=0)`."
        )


def _broadcast_one(src: int, rank: int, tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.detach().clone() if rank == src else torch.empty(
        tensor.shape, dtype=tensor.dtype, device=tensor.device
    )
    out = out.contiguous()
    dist.broadcast(out, src)
    return out


def broadcast(data: T, from_process: int = 0) -> T:
    """Send the tensors of rank ``from_process`` to every rank (new tensors).

    Every rank must call it with tensors of the same shapes and dtypes.

    Example:
        >>> accel.broadcast(torch.tensor([accel.state().rank]), from_process=1)
        tensor([1])  # rank 0 and rank 1 alike
    """
    _require_tensors("broadcast", data, "Use `accel.broadcast_object()` for Python objects.")
    _check_source("broadcast", from_process, state().world_size)
    st = begin("broadcast", data)
    if st is None:
        return data
    return map_tensors(partial(_broadcast_one, from_process, st.rank), data)


def broadcast_object(obj: T, from_process: int = 0) -> T:
    """Send a picklable object from rank ``from_process`` to every rank.

    Every rank must call it; the value passed on the other ranks is ignored.

    Example:
        >>> accel.broadcast_object({"seed": 1234} if accel.state().is_main_process else None)
        {'seed': 1234}  # rank 0 and rank 1 alike
    """
    _check_source("broadcast_object", from_process, state().world_size)
    st = begin("broadcast_object")
    if st is None:
        return obj
    box: list[Any] = [obj if st.rank == from_process else None]
    dist.broadcast_object_list(box, src=from_process)
    return box[0]  # type: ignore[no-any-return]


def _pad_one(
    dim: int, pad_index: int | float, pad_first: bool, world_size: int, tensor: torch.Tensor
) -> torch.Tensor:
    in_range = -tensor.ndim <= dim < tensor.ndim
    axis = dim % tensor.ndim if in_range and tensor.ndim else 0
    mine = torch.tensor(
        [tensor.ndim, tensor.shape[axis] if in_range and tensor.ndim else -1],
        device=tensor.device,
    )
    sizes = _all_gather(world_size, mine).reshape(world_size, 2)
    ndims = sizes[:, 0].tolist()
    if len(set(ndims)) > 1:
        raise CollectiveMismatchError(
            f"accel.pad_across_processes() needs tensors with the same number of dimensions "
            f"on every rank, got ndim per rank {ndims}. Pad tensors of one rank and the same "
            "layout on all ranks."
        )
    if not in_range or tensor.ndim == 0:
        return tensor
    longest = int(sizes[:, 1].max())
    if longest == tensor.shape[axis]:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = longest
    out = tensor.new_full(shape, pad_index)
    start = longest - tensor.shape[axis] if pad_first else 0
    out.narrow(axis, start, tensor.shape[axis]).copy_(tensor)
    return out


def pad_across_processes(
    data: T, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> T:
    """Pad tensors along ``dim`` to the longest size on any rank, so they can be gathered.

    Every rank must call it. Padding values are ``pad_index``, at the end, or at the start
    with ``pad_first=True``. Tensors with fewer than ``dim + 1`` dimensions are returned as is.

    Example:
        >>> t = torch.ones(accel.state().rank + 1)
        >>> accel.pad_across_processes(t)
        tensor([1., 0.])  # rank 0
        tensor([1., 1.])  # rank 1
    """
    _require_tensors("pad_across_processes", data, "Pad tensors only.")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CollectiveTypeError(
            f"accel.pad_across_processes(dim={dim!r}) needs an integer dimension, "
            "e.g. `accel.pad_across_processes(data, dim=1)`."
        )
    st = begin("pad_across_processes", data, shapes=False)
    if st is None:
        return data
    fn = partial(_pad_one, dim, pad_index, pad_first, st.world_size)
    return map_tensors(fn, data)


def wait_for_everyone() -> None:
    """Block until every rank has reached this call.

    Every rank must call it. A rank that never comes is named within the collective
    ``timeout`` (:class:`~accel.errors.ArrivalTimeoutError`), and ranks that meet another call
    every rank must make here (``save_state`` on one, ``wait_for_everyone`` on another) are
    named at once (:class:`~accel.errors.CollectiveMismatchError`).

    Example:
        >>> accel.wait_for_everyone()  # e.g. before reading a file the main process wrote
    """
    st = begin("wait_for_everyone", arrive="timeout")
    if st is None:
        return
    if st.backend == "nccl" and st.device.type == "cuda":
        dist.barrier(device_ids=[st.device.index or 0])
    else:
        dist.barrier()


def set_trigger() -> None:
    """Raise this rank's flag; the next :func:`check_trigger` returns True on every rank.

    Not a collective: call it on any subset of ranks (e.g. the rank that saw a NaN loss).

    Example:
        >>> if not torch.isfinite(loss):
        ...     accel.set_trigger()
    """
    scope().trigger = True


def check_trigger() -> bool:
    """True on every rank if any rank called :func:`set_trigger`; the flag is then reset.

    Every rank must call it.

    Example:
        >>> if accel.check_trigger():
        ...     break  # every rank leaves the loop together
    """
    record = scope()
    st = begin("check_trigger")
    if st is None:
        fired = record.trigger
    else:
        flag = torch.tensor([1 if record.trigger else 0], device=st.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        fired = bool(flag.item())
    if fired:
        record.trigger = False
    return fired


def _split_bounds(length: int, rank: int, world_size: int) -> tuple[int, int, int]:
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    return start, end, base + (1 if extra else 0)


def _check_splittable(value: Any) -> None:
    """Refuse what cannot be split (on every world size, so one process fails like N)."""
    if isinstance(value, Mapping):
        for item in value.values():
            _check_splittable(item)
        return
    if (
        not isinstance(value, torch.Tensor | Sequence)
        or isinstance(value, str | bytes)
        or (isinstance(value, torch.Tensor) and value.ndim == 0)
    ):
        raise CollectiveTypeError(
            f"accel.split_between_processes() splits lists, tuples, dicts of them and tensors "
            f"with at least one dimension, got {type(value).__name__} {value!r:.80}. Pass e.g. "
            "a list of prompts: `accel.split_between_processes(['a', 'b', 'c'])`."
        )


def _split_one(value: Any, rank: int, world_size: int, apply_padding: bool) -> Any:
    if isinstance(value, Mapping):
        return type(value)(  # type: ignore[call-arg]
            {k: _split_one(v, rank, world_size, apply_padding) for k, v in value.items()}
        )
    start, end, longest = _split_bounds(len(value), rank, world_size)
    missing = longest - (end - start)
    if not apply_padding or missing == 0 or len(value) == 0:
        return value[start:end]
    last = end - 1 if end > start else len(value) - 1  # an empty share repeats the input's last
    if isinstance(value, torch.Tensor):
        filler = value[last : last + 1]
        return torch.cat([value[start:end], filler.expand(missing, *filler.shape[1:])])
    padded = [*value[start:end], *([value[last]] * missing)]
    return tuple(padded) if isinstance(value, tuple) else padded


@contextmanager
def split_between_processes(inputs: T, *, apply_padding: bool = False) -> Iterator[T]:
    """Yield this rank's contiguous share of ``inputs`` (list, tuple, tensor, or dict of them).

    The first ``len % world_size`` ranks get one extra item. With ``apply_padding`` the last
    item is repeated so every rank gets the same length (then gathered results hold
    duplicates to drop). No communication happens; every rank should call it with the same
    inputs.

    Example:
        >>> with accel.split_between_processes(["a", "b", "c"]) as mine:
        ...     print(mine)
        ['a', 'b']  # rank 0
        ['c']       # rank 1
    """
    _check_splittable(inputs)
    if not isinstance(apply_padding, bool):
        raise CollectiveTypeError(
            f"accel.split_between_processes(apply_padding={apply_padding!r:.40}) must be True "
            "or False, e.g. `accel.split_between_processes(items, apply_padding=True)`."
        )
    st = state()
    if st.world_size == 1:
        yield inputs
        return
    yield _split_one(inputs, st.rank, st.world_size, apply_padding)
