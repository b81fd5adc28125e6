"""Names a package exports lazily: each loads its module on first access.

``import accel`` (and ``import accel.checkpoint``...) stays cheap: torch and the readers and
writers load when a name is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``names`` (public name -> module).

    The first access imports the module and stores the value in the package's namespace, so
    later lookups skip ``__getattr__``.

    Example:
        >>> __getattr__, __dir__ = lazy_names(__name__, {"save": "accel.weights.model_io"})
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
