"""``init_empty_weights`` / ``init_on_device``: build a module without allocating its weights.

Two mechanisms work together while the context is open:

- every parameter registered on any module (``self.w = nn.Parameter(...)``,
  ``register_parameter``, parameters assigned later) is moved to the device as it is
  registered, keeping its class, ``requires_grad`` and attributes; buffers too with
  ``include_buffers=True``. Modules whose ``__init__`` then initialises the parameters
  (``reset_parameters``) initialise them on the device: on ``meta`` that costs nothing;
- tensor factories called without a device create their result on the device directly when
  their values do not matter and the result is large (``torch.empty``, ``empty_strided``,
  ``rand``, ``randn``, ``randint``, ``normal`` of at least 64 MiB), so even a single weight
  bigger than the machine's memory is never allocated. With ``include_buffers=True`` every
  factory call without a device (``zeros``, ``ones``, ``full`` too, any size) goes there.

With ``include_buffers=False`` buffers keep their real values on the CPU (position ids,
masks, running statistics), as in Accelerate; only a buffer made directly from one of the
large random/empty factories above ends on the device with the parameters.

The settings live in a ``ContextSlot`` (``accel.core.scope``) and the factory redirection is
a ``TorchFunctionMode`` (per thread), so a block affects only the thread that entered it; the
registration patch on ``nn.Module`` is installed while at least one block is open in any
thread and removed when the last one closes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from accel.core.scope import ContextSlot
from accel.errors import DeviceMapError

__all__ = ["init_empty_weights", "init_on_device"]

_LARGE = 64 * 2**20  # bytes: results of value-free factories at least this big go to the device
_VALUE_FREE = frozenset(
    {torch.empty, torch.empty_strided, torch.rand, torch.randn, torch.randint, torch.normal}
)
_FACTORIES = _VALUE_FREE | {torch.zeros, torch.ones, torch.full}


@dataclass(frozen=True)
class _Settings:
    device: torch.device
    include_buffers: bool


_CURRENT: ContextSlot[_Settings] = ContextSlot("accel.big_model init_on_device")
_lock = threading.Lock()
_active = 0  # blocks open in all threads; the nn.Module patch is installed while > 0
_originals: dict[str, Callable[..., None]] = {}


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
    return int(numel * dtype.itemsize)


class _FactoryDevice(TorchFunctionMode):
    """Send factory calls without a device to the innermost block's device (all or large ones).

    One mode is pushed per block; every mode reads the same innermost settings, so nested
    modes agree and the innermost block decides.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        settings = _CURRENT.get()
        if (
            settings is not None
            and func in _FACTORIES
            and kwargs.get("device") is None
            and kwargs.get("out") is None
            and (
                settings.include_buffers
                or (func in _VALUE_FREE and _result_bytes(args, kwargs) >= _LARGE)
            )
        ):
            try:
                return func(*args, **{**kwargs, "device": settings.device})
            except TypeError:  # an overload without ``device=`` (normal(Tensor, Tensor))
                pass
        return func(*args, **kwargs)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    here = tensor.device
    return here.type == device.type and (device.index is None or here.index == device.index)


def _moved(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    """``param`` on ``device`` as the same class, with its ``requires_grad`` and attributes."""
    data = param.detach().to(device)
    extra = dict(param.__dict__)
    cls = type(param)
    try:  # as Accelerate does: subclasses such as quantized parameters take their attributes
        moved: nn.Parameter = cls(data, **{**extra, "requires_grad": param.requires_grad})
    except TypeError:  # a plain Parameter with extra attributes set before registration
        moved = torch.Tensor._make_subclass(cls, data, param.requires_grad)
        moved.__dict__.update(extra)
    return moved


def _register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _originals["register_parameter"](self, name, param)
    settings = _CURRENT.get()
    # a parameter already there (e.g. tied: ``head.weight = emb.weight``) stays the same object
    if settings is not None and param is not None and not _on(param, settings.device):
        self._parameters[name] = _moved(param, settings.device)


def _register_buffer(
    self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
) -> None:
    _originals["register_buffer"](self, name, tensor, persistent=persistent)
    settings = _CURRENT.get()
    if (
        settings is not None
        and settings.include_buffers
        and tensor is not None
        and not _on(tensor, settings.device)
    ):
        self._buffers[name] = tensor.to(settings.device)


_PATCHES: dict[str, Callable[..., None]] = {
    "register_parameter": _register_parameter,
    "register_buffer": _register_buffer,
}


def _install() -> None:
    global _active
    with _lock:
        if _active == 0:
            for attr, patch in _PATCHES.items():
                _originals[attr] = getattr(nn.Module, attr)
                setattr(nn.Module, attr, patch)
        _active += 1


def _uninstall() -> None:
    global _active
    with _lock:
        _active -= 1
        if _active == 0:
            for attr, patch in _PATCHES.items():
                if getattr(nn.Module, attr) is patch:  # someone patched over us: leave theirs
                    setattr(nn.Module, attr, _originals[attr])


@contextmanager
def init_on_device(
    device: torch.device | str | int, *, include_buffers: bool = False
) -> Iterator[None]:
    """Create every parameter (and, when asked, buffer) of modules built inside on ``device``.

    On ``"meta"`` nothing is allocated nor initialised. Parameters keep their class,
    ``requires_grad`` and attributes; a parameter already on ``device`` keeps its identity
    (ties made inside the block stay tied). Nestable (the innermost block wins); everything
    is restored on exit, also when the block raises. Only the thread that entered the block
    is affected.

    Args:
        device: where new parameters go (``"meta"``, ``"cpu"``, ``"cuda:0"``, ``0``...).
        include_buffers: move buffers too (and send every tensor factory call without a
            device to ``device``); by default buffers keep their values on the CPU.

    Raises:
        DeviceMapError: ``device`` is not a device.

    Example:
        >>> with accel.init_on_device("meta"):
        ...     layer = torch.nn.Linear(4096, 4096)
        >>> layer.weight.device
        device(type='meta')
    """
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceMapError(
            f"init_on_device got device={device!r}, which is not a device; use 'meta', "
            "'cpu', 'cuda:0', a GPU index or a torch.device."
        ) from None
    _install()
    previous = _CURRENT.set(_Settings(target, include_buffers))
    try:
        with _FactoryDevice():
            yield
    finally:
        _CURRENT.set(previous)
        _uninstall()


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
