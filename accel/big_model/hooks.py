"""The forward hooks behind ``dispatch_model``, ``cpu_offload`` and ``disk_offload``.

Everything a forward needs is worked out at dispatch time: each hooked module holds the list
of its offloaded slots (module attribute + the :class:`Weight` that fills it) and the device
its inputs go to. A forward then does only what moving weights takes: for each slot, put the
weight on the execution device (a view of the file or of CPU RAM when that device is the
CPU: no copy) and, after the forward, put the ``meta`` placeholder back and release the
memory. The hooks are torch's own forward pre/post hooks, so ``forward`` is never replaced,
and the post hook runs even when the forward raises (nothing stays loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accel.big_model.offload import MappedFile, give_back
from accel.core.tree import is_namedtuple
from accel.errors import DeviceMapError

__all__ = [
    "Dispatch",
    "ModuleHook",
    "Slot",
    "Weight",
    "covering_entry",
    "find_device",
    "plan_hooks",
    "preload_classes",
    "send_to_device",
]

DISPATCH_ATTR = "_accel_dispatch"
DISK = "disk"
Placement = torch.device | str  # a device, or "disk"
_CPU = torch.device("cpu")
_PRELOAD: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)  # reads its child's weights


def send_to_device(data: Any, device: torch.device) -> Any:
    """``data`` with every tensor moved to ``device`` (nested tuples, lists, dicts).

    Example:
        >>> send_to_device({"x": (torch.ones(1), 3)}, torch.device("cpu"))
        {'x': (tensor([1.]), 3)}
    """
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, list | tuple):
        items = [send_to_device(item, device) for item in data]
        if is_namedtuple(data):
            return type(data)(*items)
        return type(data)(items) if isinstance(data, tuple) else items
    if isinstance(data, Mapping):
        moved = {key: send_to_device(value, device) for key, value in data.items()}
        try:
            return type(data)(moved)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return moved
    return data


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in ``data`` (depth first), or ``None``.

    Example:
        >>> find_device([1, {"a": torch.ones(1)}])
        device(type='cpu')
    """
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, list | tuple):
        for item in data:
            found = find_device(item)
            if found is not None:
                return found
    elif isinstance(data, Mapping):
        for value in data.values():
            found = find_device(value)
            if found is not None:
                return found
    return None


class Weight:
    """One offloaded tensor (shared by all the names a tied weight has): its bytes at rest
    (a file, with a view of its private map, or a CPU tensor) and its ``meta`` placeholder.

    ``load`` puts it on the execution device once however many modules use it at the same
    time (tied weights); ``unload`` drops it when the last one is done. A weight in a file is
    read from the open file (``pread``) at each load, never through the map, so a file
    truncated by another process is a ``CheckpointError``, not a ``SIGBUS``. A weight in CPU
    memory whose execution device is the CPU (no cast) *is* the source, made once: a forward
    then only counts users.
    """

    __slots__ = (
        "device",
        "dtype",
        "file",
        "is_param",
        "key",
        "loaded",
        "placeholder",
        "release",
        "requires_grad",
        "restore",
        "source",
        "spare",
        "static",
        "users",
    )

    def __init__(
        self,
        source: torch.Tensor,
        placeholder: torch.Tensor,
        device: torch.device,
        *,
        file: MappedFile | None = None,
        key: str = "",
        restore: torch.Tensor | None = None,
    ) -> None:
        self.source = source
        self.restore = restore  # the tensor to put back on removal (a tied resident weight)
        self.placeholder = placeholder
        self.device = device
        self.dtype = placeholder.dtype
        self.file, self.key = file, key
        self.release = None if file is None else file.releaser(key)
        self.is_param = isinstance(placeholder, nn.Parameter)
        self.requires_grad = placeholder.requires_grad
        self.static = file is None and source.device == device and source.dtype == self.dtype
        self.loaded: torch.Tensor | None = self._wrap(source) if self.static else None
        self.spare: torch.Tensor | None = None  # the read buffer ``loaded`` is a view of
        self.users = 0

    def _wrap(self, value: torch.Tensor) -> torch.Tensor:
        return nn.Parameter(value, requires_grad=self.requires_grad) if self.is_param else value

    def load(self) -> torch.Tensor:
        """The weight on the execution device (loaded on first use)."""
        if self.users == 0 and not self.static:
            if self.file is None:
                value = self.source.to(device=self.device, dtype=self.dtype)
            else:
                read = self.file.read(self.key, spare=True)
                value = read.to(device=self.device, dtype=self.dtype)
                if value is read:
                    self.spare = read  # given back when the last user is done
                else:
                    give_back(read)  # copied to the device or cast: reusable now
                if self.release is not None:
                    self.release()  # pages of the map state_dict() readers made resident
            self.loaded = self._wrap(value)
        self.users += 1
        return self.loaded  # type: ignore[return-value]

    def unload(self) -> None:
        """One user fewer; at none, drop the loaded tensor and the file's pages."""
        self.users -= 1
        if self.users == 0 and not self.static:
            self.loaded = None
            if self.spare is not None:
                spare, self.spare = self.spare, None
                give_back(spare)

    def at_rest(self) -> torch.Tensor:
        """The value on the CPU without loading it: the view itself when no cast is needed
        (for a file, a view of its map: read lazily, page by page, when used)."""
        return self.source.to(dtype=self.dtype)

    def materialize(self) -> torch.Tensor:
        """A tensor of its own to put back (read from the file when it is in one)."""
        if self.restore is not None:
            return self.restore
        if self.file is not None:
            return self._wrap(self.file.read(self.key).to(dtype=self.dtype))
        return self._wrap(self.at_rest())


class Slot:
    """An attribute of a module filled by an offloaded weight during forwards."""

    __slots__ = ("module", "name", "store", "users", "weight")

    def __init__(self, module: nn.Module, name: str, weight: Weight) -> None:
        self.module, self.name, self.weight = module, name, weight
        self.store: dict[str, Any] = module._parameters if weight.is_param else module._buffers
        self.users = 0

    def fill(self, value: torch.Tensor) -> None:
        """Put ``value`` in the attribute (as parameter or buffer)."""
        self.store[self.name] = value


def _move_inputs(args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    for arg in args:  # the common case: tensors already there, nothing to rebuild
        if not isinstance(arg, torch.Tensor) or arg.device != device:
            return send_to_device(args, device)  # type: ignore[no-any-return]
    return args


class ModuleHook:
    """The pre/post forward hooks of one module: move inputs to ``device``, load ``slots``
    before the forward and unload them after; with ``io_same_device``, return the output on
    the device of the first input tensor."""

    def __init__(
        self, device: torch.device | None, slots: list[Slot], *, io_same_device: bool = False
    ) -> None:
        self.device = device
        self.slots = tuple(slots)
        self.io_same_device = io_same_device
        self.active = 0  # forwards in progress whose pre hook completed
        self.input_devices: list[torch.device | None] = []

    def pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Before the forward: load the slots, move the inputs."""
        if self.io_same_device:
            found = find_device(args)
            self.input_devices.append(found if found is not None else find_device(kwargs))
        done = 0
        try:
            for slot in self.slots:
                value = slot.weight.load()
                done += 1
                slot.users += 1
                slot.store[slot.name] = value
        except BaseException:
            for slot in self.slots[:done]:
                self._unload(slot)
            if self.io_same_device:
                self.input_devices.pop()
            raise
        self.active += 1
        device = self.device
        if device is None:
            return None
        if kwargs:
            kwargs = send_to_device(kwargs, device)
        return _move_inputs(args, device), kwargs

    def post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """After the forward (also when it raised): unload the slots, move the output."""
        if self.active == 0:  # the pre hook did not run, or failed and cleaned up
            return None
        self.active -= 1
        for slot in self.slots:
            self._unload(slot)
        if self.io_same_device:
            device = self.input_devices.pop()
            if device is not None and output is not None:
                return send_to_device(output, device)
        return None

    @staticmethod
    def _unload(slot: Slot) -> None:
        slot.users -= 1
        if slot.users == 0:
            slot.store[slot.name] = slot.weight.placeholder
        slot.weight.unload()


class _StateDictHook:
    """``state_dict()`` of a module with offloaded slots: the real values (views of the file
    or the CPU copy), not the ``meta`` placeholders."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, meta: Any
    ) -> None:
        for slot in self.slots:
            key = prefix + slot.name
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                state_dict[key] = slot.weight.at_rest()


@attrs.define(eq=False)
class Dispatch:
    """What a dispatch added to a model, so it can be removed exactly."""

    slots: list[Slot] = attrs.field(factory=list)
    handles: list[RemovableHandle] = attrs.field(factory=list)
    # buffers of offloaded modules kept on the (GPU) execution device: back to the CPU with
    # their module's weights when the hooks are removed
    home_buffers: list[tuple[nn.Module, str]] = attrs.field(factory=list)

    def install(self, hooks: Mapping[nn.Module, ModuleHook]) -> None:
        """Register the forward hooks and the ``state_dict`` hooks, fill the placeholders."""
        owners: dict[nn.Module, list[Slot]] = {}
        for slot in self.slots:
            slot.fill(slot.weight.placeholder)
            owners.setdefault(slot.module, []).append(slot)
        for module, slots in owners.items():
            on_save = _StateDictHook(slots)
            register = module.register_state_dict_post_hook
            self.handles.append(register(on_save))  # type: ignore[no-untyped-call]
        for module, hook in hooks.items():
            pre: Callable[..., Any] = hook.pre
            self.handles.append(
                module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
            )
            self.handles.append(
                module.register_forward_hook(hook.post, with_kwargs=True, always_call=True)
            )

    def remove_handles(self) -> None:
        """Unregister every hook."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def restore(self) -> None:
        """Put real CPU tensors back in every offloaded slot (one per tied weight): all are
        read first, so a file that changed (a ``CheckpointError``) leaves every slot as it was.
        """
        values: dict[int, torch.Tensor] = {}
        for slot in self.slots:
            if id(slot.weight) not in values:
                values[id(slot.weight)] = slot.weight.materialize()
        for slot in self.slots:
            slot.fill(values[id(slot.weight)])
        for module, name in self.home_buffers:
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.device.type != "cpu":
                module._buffers[name] = buffer.to("cpu")


def covering_entry(device_map: Mapping[str, Placement], name: str) -> str | None:
    """The device map entry covering ``name``: itself, its closest listed ancestor, or ``""``.

    Example:
        >>> covering_entry({"": "cpu", "layers.1": "disk"}, "layers.1.fc.weight")
        'layers.1'
    """
    while True:
        if name in device_map:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


def preload_classes(
    classes: Iterable[type[nn.Module] | str] | None,
) -> tuple[type[nn.Module] | str, ...]:
    """``nn.MultiheadAttention`` and ``classes`` (checked): modules that load their subtree.

    Example:
        >>> preload_classes(["MyBlock"])
        (<class 'torch.nn.modules.activation.MultiheadAttention'>, 'MyBlock')
    """
    extra = tuple(classes or ())
    for item in extra:
        if not isinstance(item, str) and not (
            isinstance(item, type) and issubclass(item, nn.Module)
        ):
            raise DeviceMapError(
                f"preload_module_classes holds {item!r}, which is neither an nn.Module class "
                "nor a class name. Pass e.g. `preload_module_classes=['MyBlock']`."
            )
    return _PRELOAD + extra


def _is_preload(module: nn.Module, preload: tuple[type[nn.Module] | str, ...]) -> bool:
    return any(
        type(module).__name__ == p if isinstance(p, str) else isinstance(module, p) for p in preload
    )


def plan_hooks(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    device_map: Mapping[str, Placement],
    slots: list[Slot],
    main: torch.device,
    offload_cpu: bool,
    preload: tuple[type[nn.Module] | str, ...],
) -> dict[nn.Module, ModuleHook]:
    """One hook per module that needs one: the model (inputs to ``main``, output back to the
    input's device), each map entry (inputs to its execution device), each module whose
    offloaded weights it loads (itself, or everything under a ``preload`` module).

    Example:
        >>> hooks = plan_hooks(model, dict(model.named_modules()), {"": "disk"}, slots,
        ...                    torch.device("cpu"), False, preload_classes(None))
    """
    names = {id(m): n for n, m in reversed(list(modules.items()))}  # first name wins
    preload_roots = [n for n, m in modules.items() if _is_preload(m, preload) and names[id(m)] == n]

    def loader(name: str) -> str:
        for root in preload_roots:
            if name == root or not root or name.startswith(root + "."):
                return root
        return name

    def exec_device(name: str) -> torch.device | None:
        entry = covering_entry(device_map, name)
        if entry is None:
            return None
        where = device_map[entry]
        if where == DISK or (where == _CPU and offload_cpu):
            return main
        return torch.device(where)

    by_loader: dict[str, list[Slot]] = {}
    for slot in slots:
        by_loader.setdefault(loader(names[id(slot.module)]), []).append(slot)
    hooked = {""} | {n for n in device_map if n in modules} | set(by_loader)
    hooks: dict[nn.Module, ModuleHook] = {}
    for name in sorted(hooked, key=lambda n: (n.count("."), n)):
        module = modules[name]
        if module in hooks:
            continue
        device = main if name == "" else exec_device(name)
        group = by_loader.get(name, [])
        if device is None and group:
            device = group[0].weight.device
        hooks[module] = ModuleHook(device, group, io_same_device=module is model)
    return hooks
