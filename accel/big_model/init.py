"""``init_empty_weights`` / ``init_on_device``: build a module without allocating its weights.

Two mechanisms work together while the context is open:

- every parameter registered on any module (``self.w = nn.Parameter(...)``,
  ``register_parameter``, parameters assigned later) is moved to the device as it is
  registered, keeping its class, ``requires_grad`` and attributes; buffers too with
  ``include_buffers=True``;
- tensor factories called without a device (``torch.empty``, ``torch.randn``...) create their
  result on the device directly when it would be large (at least 64 MiB), so even a single
  weight bigger than the machine's memory is never allocated nor initialised. With
  ``include_buffers=True`` every factory call without a device goes to the device.

With ``include_buffers=False`` small buffers keep their real values on the CPU (position ids,
masks, running statistics), as in Accelerate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["init_empty_weights", "init_on_device"]

_LARGE = 64 * 2**20  # bytes: factory results at least this big are created on the device
_FACTORIES = frozenset(
    {
        torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
        torch.randint, torch.empty_strided, torch.normal,
    }
)
_patch_lock = threading.Lock()


def _result_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The size a factory call would allocate, or 0 when it cannot be told cheaply.

    The shape is the ``size=`` keyword, else the first positional tuple/list/``Size``
    (``full``, ``randint``, ``normal``), else the leading ints (``empty(2, 3)``).
    """
    dims: Any = kwargs.get("size")
    if dims is None:
        dims = next((a for a in args if isinstance(a, (tuple, list, torch.Size))), None)
    if dims is None:
        dims = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    try:
        numel = 1
        for d in dims:
            numel *= int(d)
    except (TypeError, ValueError):
        return 0
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return numel * dtype.itemsize


class _FactoryDevice(TorchFunctionMode):
    """Send factory calls without an explicit device to ``device`` (all, or the large ones)."""

    def __init__(self, device: torch.device, everything: bool) -> None:
        super().__init__()
        self.device = device
        self.everything = everything

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if (
            func in _FACTORIES
            and kwargs.get("device") is None
            and kwargs.get("out") is None
            and (self.everything or _result_bytes(args, kwargs) >= _LARGE)
        ):
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        extra = dict(tensor.__dict__)
        extra["requires_grad"] = tensor.requires_grad
        return type(tensor)(tensor.to(device), **extra)
    return tensor.to(device)


@contextmanager
def init_on_device(device: torch.device | str, *, include_buffers: bool = False) -> Iterator[None]:
    """Create every parameter (and, when asked, buffer) of modules built inside on ``device``.

    On ``"meta"`` nothing is allocated nor initialised. Parameters keep their class and
    ``requires_grad``. Nestable; the patched registration is restored on exit, also when the
    block raises.

    Args:
        device: where new parameters go (``"meta"``, ``"cpu"``, ``"cuda:0"``...).
        include_buffers: move buffers too (and send every tensor factory call without a
            device to ``device``); by default buffers keep their values on the CPU.

    Example:
        >>> with accel.init_on_device("meta"):
        ...     layer = torch.nn.Linear(4096, 4096)
        >>> layer.weight.device
        device(type='meta')
    """
    target = torch.device(device)
    with _patch_lock:
        old_parameter = nn.Module.register_parameter
        old_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        old_parameter(self, name, param)
        # a parameter already there (e.g. tied: ``head.weight = emb.weight``) stays the same object
        if param is not None and param.device != target:
            self._parameters[name] = _moved(param, target)  # type: ignore[assignment]

    def register_buffer(
        self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        old_buffer(self, name, tensor, persistent=persistent)
        if tensor is not None and tensor.device != target:
            self._buffers[name] = tensor.to(target)

    mode = _FactoryDevice(target, everything=include_buffers)
    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        with mode:
            yield
    finally:
        nn.Module.register_parameter = old_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = old_buffer  # type: ignore[method-assign]


@contextmanager
def init_empty_weights(*, include_buffers: bool = False) -> Iterator[None]:
    """Build models inside without memory: parameters (and buffers if asked) on ``meta``.

    Load real weights afterwards with ``accel.load_checkpoint_and_dispatch`` or
    ``accel.load_checkpoint_in_model``.

    Args:
        include_buffers: put buffers on ``meta`` too; by default they keep their values.

    Example:
        >>> with accel.init_empty_weights():
        ...     model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(64)])
        >>> next(model.parameters()).is_meta     # 17 GB of weights, none allocated
        True
    """
    with init_on_device("meta", include_buffers=include_buffers):
        yield
