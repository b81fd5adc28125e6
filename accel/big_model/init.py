"""``init_empty_weights`` / ``init_on_device``: build a module without allocating its weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["init_empty_weights", "init_on_device"]


@contextmanager
def init_on_device(device: torch.device | str, *, include_buffers: bool = False) -> Iterator[None]:
    """TODO (helper A)."""
    raise NotImplementedError
    yield  # type: ignore[unreachable]


@contextmanager
def init_empty_weights(*, include_buffers: bool = False) -> Iterator[None]:
    """TODO (helper A)."""
    with init_on_device("meta", include_buffers=include_buffers):
        yield  # type: ignore[unreachable]
