"""Map and zip over nested list/tuple/namedtuple/dict structures of tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["first_non_tensor", "is_namedtuple", "map_tensors", "tensor_leaves", "zip_map_tensors"]


def is_namedtuple(value: object) -> bool:
    """True for instances of ``collections.namedtuple`` / ``typing.NamedTuple`` classes."""
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuild(like: Any, items: Sequence[Any]) -> Any:
    if is_namedtuple(like):
        return type(like)(*items)
    if isinstance(like, tuple):
        return tuple(items)
    return list(items)


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``fn`` to every tensor in ``data``, keeping the structure; other leaves stay.

    Example:
        >>> map_tensors(lambda t: t * 2, {"a": [torch.tensor(1)]})
        {'a': [tensor(2)]}
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, list | tuple):
        return _rebuild(data, [map_tensors(fn, item) for item in data])
    if isinstance(data, Mapping):
        return type(data)({key: map_tensors(fn, value) for key, value in data.items()})  # type: ignore[call-arg]
    return data


def zip_map_tensors(fn: Callable[..., Any], first: Any, *others: Any) -> Any:
    """Apply ``fn(t0, t1, ...)`` to tensors at the same place in structures of one shape."""
    if isinstance(first, torch.Tensor):
        return fn(first, *others)
    if isinstance(first, list | tuple):
        return _rebuild(
            first, [zip_map_tensors(fn, *items) for items in zip(first, *others, strict=True)]
        )
    if isinstance(first, Mapping):
        return type(first)(  # type: ignore[call-arg]
            {key: zip_map_tensors(fn, value, *(o[key] for o in others))
             for key, value in first.items()}
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
