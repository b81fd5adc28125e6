"""Nested state dicts <-> (JSON structure, flat tensor dict), with no pickle.

Tensors become ``{"__tensor__": key}`` references into a flat dict saved with safetensors;
tuples, dicts with non-string keys, dtypes and non-finite floats get small tagged forms so the
round trip gives back the same Python values. Anything else is refused with an error naming
its path, rather than pickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from accel.errors import CheckpointError

__all__ = ["decode", "encode"]

_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"
_DTYPE, _FLOAT = "__dtype__", "__float__"


def encode(value: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """JSON-ready form of ``value``; tensors are moved into ``tensors`` under their path."""
    if isinstance(value, torch.Tensor):
        key = base = path.lstrip(".") or "value"
        while key in tensors:  # e.g. keys "a.b" and "a" -> "b" flatten alike
            key = f"{base}#{len(tensors)}"
        tensors[key] = value
        return {_TENSOR: key}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: repr(value)}
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: encode(v, tensors, f"{path}.{k}") for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, str | int | bool) and k is not None:
                raise CheckpointError(
                    f"Cannot store the key {k!r} at {path.lstrip('.') or '<root>'!r} without "
                    "pickle: keys must be str, int or bool. Convert it in `state_dict()`."
                )
            items.append([k, encode(v, tensors, f"{path}.{k}")])
        return {_DICT: items}
    raise CheckpointError(
        f"Cannot store a {type(value).__name__} at {path.lstrip('.') or '<root>'!r} without "
        "pickle (accel checkpoints hold tensors, numbers, strings, lists, tuples and dicts). "
        "Return plain values from that object's `state_dict()`."
    )


def _malformed(tag: str, inner: Any) -> CheckpointError:
    return CheckpointError(
        f"The checkpoint's structure holds {{{tag!r}: {inner!r:.60}}}, which accel never "
        "writes: the checkpoint is corrupted or crafted. Load an earlier one."
    )


def decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        CheckpointError: a tagged form that :func:`encode` never writes (a tensor reference
            that is no name, a tuple or dict form that is no list of items, a float that
            does not parse), or a tensor the tensor file lacks.
    """
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == _TENSOR:
            if not isinstance(inner, str):
                raise _malformed(tag, inner)
            if inner not in tensors:
                raise CheckpointError(
                    f"The checkpoint's structure names tensor {inner!r}, which its tensor file "
                    "does not hold: the checkpoint is corrupted. Load an earlier one."
                )
            return tensors[inner]
        if tag == _TUPLE:
            if not isinstance(inner, list):
                raise _malformed(tag, inner)
            return tuple(decode(v, tensors) for v in inner)
        if tag == _DICT:
            if not isinstance(inner, list) or not all(
                isinstance(item, list) and len(item) == 2
                and (item[0] is None or isinstance(item[0], str | int | bool))
                for item in inner
            ):
                raise _malformed(tag, inner)
            return {k: decode(v, tensors) for k, v in inner}
        if tag == _DTYPE:
            dtype = getattr(torch, inner, None) if isinstance(inner, str) else None
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(
                    f"The checkpoint names the dtype {inner!r:.60}, which is not a torch dtype: "
                    "the checkpoint is corrupted or crafted. Load an earlier one."
                )
            return dtype
        if tag == _FLOAT:
            if inner not in ("inf", "-inf", "nan"):  # what encode writes (repr of such floats)
                raise _malformed(tag, inner)
            return float(inner)
    return {k: decode(v, tensors) for k, v in value.items()}
