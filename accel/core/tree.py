"""Map and zip over nested list/tuple/namedtuple/dict structures of tensors; tell DTensors;
find the plain tensor inside a wrapper subclass."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch

__all__ = [
    "dtensor_type", "first_non_tensor", "holds_dtensors", "is_namedtuple", "map_tensors",
    "plain_tensor", "tensor_leaves", "zip_map_tensors",
]

T = TypeVar("T")


def is_namedtuple(value: object) -> bool:
    """True for instances of ``collections.namedtuple`` / ``typing.NamedTuple`` classes."""
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuild(like: Any, items: Sequence[Any]) -> Any:
    if is_namedtuple(like):
        return type(like)(*items)
    if isinstance(like, tuple):
        return tuple(items)
    return list(items)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], data: T) -> T:
    """Apply ``fn`` to every tensor in ``data``, keeping the structure; other leaves stay.

    The result has the type of ``data``: ``fn`` maps tensors to tensors.

    Example:
        >>> map_tensors(lambda t: t * 2, {"a": [torch.tensor(1)]})
        {'a': [tensor(2)]}
    """
    return cast(T, _map(fn, data))


def _map(fn: Callable[[torch.Tensor], torch.Tensor], data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, list | tuple):
        return _rebuild(data, [_map(fn, item) for item in data])
    if isinstance(data, Mapping):
        mapping: Any = type(data)  # a Mapping class that takes a dict, as dict does
        return mapping({key: _map(fn, value) for key, value in data.items()})
    return data


def zip_map_tensors(fn: Callable[..., torch.Tensor], first: T, *others: Any) -> T:
    """Apply ``fn(t0, t1, ...)`` to tensors at the same place in structures of one shape.

    The result has the type of ``first``.

    Example:
        >>> zip_map_tensors(torch.add, {"a": torch.tensor(1)}, {"a": torch.tensor(2)})
        {'a': tensor(3)}
    """
    return cast(T, _zip_map(fn, first, *others))


def _zip_map(fn: Callable[..., torch.Tensor], first: Any, *others: Any) -> Any:
    if isinstance(first, torch.Tensor):
        return fn(first, *others)
    if isinstance(first, list | tuple):
        return _rebuild(
            first, [_zip_map(fn, *items) for items in zip(first, *others, strict=True)]
        )
    if isinstance(first, Mapping):
        mapping: Any = type(first)
        return mapping(
            {key: _zip_map(fn, value, *(o[key] for o in others)) for key, value in first.items()}
        )
    return first


def tensor_leaves(data: Any) -> list[torch.Tensor]:
    """Every tensor in ``data``, depth first, in the order :func:`map_tensors` visits them."""
    leaves: list[torch.Tensor] = []

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        leaves.append(tensor)
        return tensor

    map_tensors(visit, data)
    return leaves


def first_non_tensor(data: Any) -> tuple[str, object] | None:
    """The path and value of the first leaf of ``data`` that is not a tensor, or ``None``.

    Example:
        >>> first_non_tensor({"a": [torch.zeros(1), 3]})
        ("['a'][1]", 3)
    """
    if isinstance(data, torch.Tensor):
        return None
    if isinstance(data, list | tuple):
        for index, item in enumerate(data):
            found = first_non_tensor(item)
            if found is not None:
                return f"[{index}]{found[0]}", found[1]
        return None
    if isinstance(data, Mapping):
        for key, value in data.items():
            found = first_non_tensor(value)
            if found is not None:
                return f"[{key!r}]{found[0]}", found[1]
        return None
    return "", data


def dtensor_type() -> type[torch.Tensor] | None:
    """torch's ``DTensor`` class, or ``None`` when nothing imported it (so none exists)."""
    module = sys.modules.get("torch.distributed.tensor")
    found = getattr(module, "DTensor", None) if module is not None else None
    return found if isinstance(found, type) else None


def holds_dtensors(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` is a DTensor (e.g. the parameters of an FSDP2 model)."""
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``tensor``'s values when it is a wrapper subclass.

    A wrapper subclass (torch's ``__tensor_flatten__`` protocol, e.g. the weights torchao's
    float8 all-gather wraps under FSDP2) has no storage of its own: reading its bytes reads
    nothing valid. Its inner tensor of the same shape and dtype holds the values. Any other
    tensor (a DTensor too: take its local tensor first) is returned as it is.

    Example:
        >>> plain_tensor(torch.ones(2)).shape
        torch.Size([2])
    """
    dtensor = dtensor_type()
    if type(tensor) is torch.Tensor or (dtensor is not None and isinstance(tensor, dtensor)):
        return tensor
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if not callable(flatten):
        return tensor
    names, _ = flatten()
    for name in names:
        inner = getattr(tensor, name, None)
        if (isinstance(inner, torch.Tensor) and inner.shape == tensor.shape
                and inner.dtype == tensor.dtype):
            return plain_tensor(inner)
    return tensor
