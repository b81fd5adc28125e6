"""Progress bars that show once: a tqdm bar on the main process, plain iteration elsewhere."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from accel.core.state import state
from accel.errors import ArgumentTypeError

__all__ = ["PlainProgress", "progress"]

T = TypeVar("T")


class PlainProgress(Generic[T]):
    """Iterates ``iterable`` unchanged; tqdm's common methods are accepted and do nothing.

    What :func:`progress` returns when no bar is shown and tqdm is not installed, so code
    written for a tqdm bar (``set_postfix``, ``update``, ``with``...) runs on every rank.
    """

    def __init__(self, iterable: Iterable[T] | None = None, total: int | None = None) -> None:
        self.iterable = iterable
        self.total = total

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise ArgumentTypeError("This progress bar has no iterable; call `update()` instead.")
        return iter(self.iterable)

    def __len__(self) -> int:
        if self.iterable is None:
            if self.total is None:
                raise ArgumentTypeError("This progress bar has neither an iterable nor a total.")
            return self.total
        return len(self.iterable)  # type: ignore[arg-type]

    def __enter__(self) -> PlainProgress[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        """Does nothing."""

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        """Does nothing."""

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        """Does nothing."""

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        """Does nothing."""

    def set_description_str(self, *args: Any, **kwargs: Any) -> None:
        """Does nothing."""

    def write(self, *args: Any, **kwargs: Any) -> None:
        """Does nothing."""

    def refresh(self) -> None:
        """Does nothing."""

    def reset(self, total: int | None = None) -> None:
        """Does nothing."""

    def close(self) -> None:
        """Does nothing."""


def progress(
    iterable: Iterable[T] | None = None, *, main_process_only: bool = True, **tqdm_kwargs: Any
) -> Any:
    """Wrap ``iterable`` in a tqdm progress bar shown on the main process only.

    With tqdm installed (extra ``accel[progress]``) every rank gets a tqdm object (so
    ``set_postfix`` & co. work everywhere), disabled except on the main process. Without tqdm,
    a :class:`PlainProgress` iterates the iterable unchanged. ``len()`` is the iterable's.
    Not a collective; nothing is communicated.

    Args:
        iterable: what to iterate (``None`` for a manual bar driven by ``update``).
        main_process_only: ``False`` shows a bar on every rank.
        **tqdm_kwargs: passed to ``tqdm`` (``desc``, ``total``, ``leave``, ``disable``...).

    Returns:
        A ``tqdm`` bar, or a :class:`PlainProgress` when tqdm is not installed.

    Example:
        >>> for batch in accel.progress(loader, desc="epoch 1"):
        ...     train_step(batch)
    """
    kind = type(iterable)
    if iterable is not None and not (hasattr(kind, "__iter__") or hasattr(kind, "__getitem__")):
        raise ArgumentTypeError(
            f"accel.progress() wraps an iterable, got {type(iterable).__name__} "
            f"{iterable!r:.60}. Pass what you iterate, e.g. `accel.progress(loader)`, or "
            f"`accel.progress(total={iterable!r:.20})` for a bar driven by `update()`."
        )
    show = state().is_main_process or not main_process_only
    if importlib.util.find_spec("tqdm") is None:
        return PlainProgress(iterable, tqdm_kwargs.get("total"))
    tqdm = importlib.import_module("tqdm.auto").tqdm
    tqdm_kwargs["disable"] = bool(tqdm_kwargs.get("disable", False)) or not show
    return tqdm(iterable, **tqdm_kwargs)
