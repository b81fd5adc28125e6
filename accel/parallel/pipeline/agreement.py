"""Every rank of a pipeline agrees on the batch's shapes, riding on the step's last collective.

torch's stages learn the shapes they pass from the first step (shape inference) and keep
them; a rank fed a batch of other shapes than its peers' fails in the user's loss (a raw
shape error) or in gloo (an abort). ``pipeline_step`` therefore describes each rank's batch
as a row of numbers (the first tensor's shape of the inputs and of the labels, and a CRC of
every tensor's shape and dtype) and the ranks compare rows:

- on the first step, before the schedule runs (one small ``all_gather``, while torch's shape
  inference exchanges metadata anyway); the shapes agreed then are kept (:class:`Agreed`);
- on every later step, inside the step's one collective, which hands the last stage's loss to
  every rank (an ``all_gather`` of the rows in place of the loss's broadcast): no collective
  more. A rank whose batch differs from the kept shapes runs the step on a stand-in of those
  shapes (zeros; its loss is not computed), so that every rank reaches that collective, and
  then every rank raises alike.

Example:
    >>> row = batch_row(x, y)                              # this rank's batch, as numbers
    >>> rows = exchange(pipe, row)                          # every rank's, on every rank
    >>> check_rows(pipe, rows)                              # raises on every rank alike
"""

from __future__ import annotations

import zlib
from typing import Any

import attrs
import torch

from accel.errors import CollectiveMismatchError, ConfigError

__all__ = ["Agreed", "batch_row", "check_rows", "exchange", "signature", "stand_in"]

_DIMS = 6  # dims of the first tensor's shape a row shows (the CRC covers every dim)
_PART = 3 + _DIMS  # present, ndim, the dims, the CRC
LOSS = 0
"""The row's slot for the last stage's mean loss (0 on the other ranks)."""
_INPUTS, _LABELS = 1, 1 + _PART
WIDTH = 1 + 2 * _PART
"""The numbers in one rank's row."""

Signature = tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]
"""Each positional value's (shape, dtype), ``None`` for a value that is not a tensor."""


@attrs.define
class Agreed:
    """The batch's shapes every rank agreed on at the pipeline's first step (the shapes torch's
    stages were built for), kept with the pipeline: this rank's signatures (for stand-ins) and
    the agreed rows' parts (the same on every rank, for the checks).

    Example:
        >>> pipeline_of(model).agreed.inputs
        (((8, 4), torch.float32),)
    """

    inputs: Signature | None = None
    labels: Signature | None = None
    parts: tuple[tuple[float, ...] | None, tuple[float, ...] | None] = (None, None)
    done: bool = False

    def keep(self, inputs: Any, labels: Any, rows: list[list[float]]) -> None:
        """Keep this step's shapes (called once the ranks agreed on them)."""
        self.inputs, self.labels = signature(inputs), signature(labels)
        self.parts = (next(iter(_distinct(rows, _INPUTS)), None),
                      next(iter(_distinct(rows, _LABELS)), None))
        self.done = True


def _values(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def signature(value: Any) -> Signature | None:
    """The (shape, dtype) of each of ``value``'s positional tensors; ``None`` without one.

    Example:
        >>> signature((torch.zeros(8, 4), 3))
        (((8, 4), torch.float32), None)
    """
    values = _values(value)
    sig = tuple((tuple(int(d) for d in v.shape), v.dtype) if isinstance(v, torch.Tensor)
                else None for v in values)
    return sig if any(s is not None for s in sig) else None


def _part(sig: Signature | None) -> list[float]:
    if sig is None:
        return [0.0] * _PART
    shape = next(s for s in sig if s is not None)[0]
    dims = [float(d) for d in shape[:_DIMS]] + [-1.0] * (_DIMS - min(len(shape), _DIMS))
    crc = zlib.crc32(repr([(s[0], str(s[1])) if s else None for s in sig]).encode())
    return [1.0, float(len(shape)), *dims, float(crc)]


def batch_row(inputs: Any, labels: Any, agreed: Agreed | None = None) -> list[float]:
    """This rank's batch as :data:`WIDTH` numbers (slot :data:`LOSS` left 0); the parts of
    shapes the ranks agreed on come from ``agreed`` (no CRC computed on the steady path).

    Example:
        >>> len(batch_row(torch.zeros(8, 4), torch.zeros(8, 2)))
        19
    """
    parts: list[float] = []
    for value, kept, part in ((inputs, None if agreed is None else agreed.inputs,
                               None if agreed is None else agreed.parts[0]),
                              (labels, None if agreed is None else agreed.labels,
                               None if agreed is None else agreed.parts[1])):
        sig = signature(value)
        parts.extend(part if part is not None and kept is not None and sig == kept
                     else _part(sig))
    return [0.0, *parts]


def exchange(group: Any, row: torch.Tensor) -> list[list[float]]:
    """Every pipeline rank's row (``row``: :data:`WIDTH` float64 numbers on the state's
    device), in pipeline-rank order; one ``all_gather`` over the pipeline group.

    Every rank of the pipeline must call it.

    Example:
        >>> exchange(pipe.group, torch.tensor(batch_row(x, y), dtype=torch.float64))[1][LOSS]
        0.0
    """
    import torch.distributed as dist

    size = dist.get_world_size(group)
    rows = torch.empty(size * WIDTH, dtype=row.dtype, device=row.device)
    dist.all_gather_single(rows, row.contiguous(), group=group)
    flat = rows.tolist()
    return [flat[r * WIDTH:(r + 1) * WIDTH] for r in range(size)]


def _shape(part: list[float]) -> tuple[int, ...]:
    return tuple(int(d) for d in part[2:2 + min(int(part[1]), _DIMS)])


def _describe(part: list[float], parts: set[tuple[float, ...]]) -> str:
    if not part[0]:
        return "none"
    hidden = any(p[1:-1] == tuple(part[1:-1]) and p[-1] != part[-1] for p in parts)
    return f"{_shape(part)!r}{' (other tensors or dtypes differ)' if hidden else ''}"


def _distinct(rows: list[list[float]], start: int) -> set[tuple[float, ...]]:
    return {tuple(r[start:start + _PART]) for r in rows if r[start]}


def check_rows(rows: list[list[float]], *, group: Any, rank_stages: Any, agreed: Agreed,
               op: str = "pipeline_step") -> None:
    """Raise alike on every rank when the ranks' batches differ, or differ from the shapes
    the stages were built for (``agreed``, once kept).

    Args:
        rows: every pipeline rank's row (:func:`exchange`).
        group: the pipeline group (to name the ranks by their global rank).
        rank_stages: the stages each pipeline rank runs (named in the message).
        agreed: the pipeline's kept shapes.
        op: the call named in the message.

    Raises:
        CollectiveMismatchError: the pipeline's ranks were given batches of different
            shapes; the message names each rank's.
        ConfigError: every rank's batch has shapes other than the first step's.

    Example:
        >>> check_rows([batch_row(x, y), batch_row(x[:4], y[:4])], group=pipe.group,
        ...            rank_stages=pipe.rank_stages, agreed=pipe.agreed)
        Traceback (most recent call last):
        CollectiveMismatchError: pipeline_step: the ranks of one pipeline were given ...
    """
    inputs, labels = _distinct(rows, _INPUTS), _distinct(rows, _LABELS)
    if len(inputs) > 1 or len(labels) > 1:
        import torch.distributed as dist

        said = "; ".join(
            f"rank {dist.get_global_rank(group, r)} (stages "
            f"{list(rank_stages[r]) if rank_stages else r}): "
            f"inputs {_describe(row[_INPUTS:_INPUTS + _PART], inputs)}, "
            f"labels {_describe(row[_LABELS:_LABELS + _PART], labels)}"
            for r, row in enumerate(rows))
        raise CollectiveMismatchError(
            f"{op}: the ranks of one pipeline were given batches of different shapes ({said}); "
            "torch's stages pass each microbatch from rank to rank, so every rank of a "
            "pipeline must be given the same batch (the first stage reads the inputs, the "
            "last the labels). Feed every rank of the pipeline the same batches, e.g. through "
            "`accel.prepare_data_loader(loader)` (it gives every stage of a data-parallel "
            "replica the same batches)."
        )
    if not agreed.done:
        return
    for name, parts, kept in zip(("inputs", "labels"), (inputs, labels), agreed.parts,
                                 strict=True):
        if kept is None or not parts or next(iter(parts)) == kept:
            continue
        (part,) = parts
        raise ConfigError(
            f"{op}: this step's {name} have the shape {_shape(list(part))!r} on every rank, "
            f"but the pipeline's stages were built on its first step for "
            f"{_shape(list(kept))!r} (the other tensors' shapes and the dtypes count too), and "
            "torch's stages keep the shapes of their first step. Give every step batches of "
            "one shape (e.g. `drop_last=True` on the DataLoader, sequences padded to one "
            "length)."
        )


def stand_in(sig: Signature, given: Any, device: torch.device) -> tuple[Any, ...]:
    """Zeros of the agreed shapes in place of a batch that has others (its non-tensor values
    kept), so that the step runs to its collective and every rank raises there alike.

    Example:
        >>> stand_in(pipe.agreed.inputs, x[:3], device)[0].shape
        torch.Size([8, 4])
    """
    values = _values(given)
    return tuple(torch.zeros(s[0], dtype=s[1], device=device) if s is not None
                 else (values[i] if i < len(values) else None) for i, s in enumerate(sig))
