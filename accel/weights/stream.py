"""Stream a checkpoint into a model, one weights file at a time.

Shared by ``load_checkpoint_in_model`` and ``load_checkpoint_and_dispatch``. Loading has two
phases. :func:`plan_load` reads only what describes the checkpoint (safetensors headers, the
tensor table of torch files) and checks it against the model: keys, shapes, tied weights,
where each tensor goes. Nothing in the model changes until that has passed. :func:`stream`
then reads the files one after the other and puts each tensor in its place:

* a tensor already allocated in the model, on its target device with its dtype, is
  overwritten in place (the parameter object, and an optimizer holding it, stay valid);
* any other tensor (``meta``, another device or dtype) becomes a new parameter or buffer
  made from the loaded tensor, without a second copy: a safetensors tensor bound for the CPU
  in its own dtype *is* a view of the file's private (copy-on-write) memory map, as with
  ``safetensors`` itself; so is a tensor of a torch file (``torch.load(mmap=True)``), unless
  the file also holds disk-placed weights;
* a tensor placed on ``"disk"`` is not read when it is in a safetensors file: a
  :class:`Source` records where its bytes are, to be mapped in place. A torch file's tensor
  is written to the offload folder as safetensors instead.

Torch files are always read with ``weights_only=True``: a file holding anything but tensors
and plain containers is refused before any code in it could run. A torch zip is checked before
it is mapped (:mod:`accel._files.torch_zip`): compressed members, or members whose sizes
differ from what the pickle declares, would map as wrong values and are refused.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import attrs
import torch
from torch import nn

from accel._files.format import read_safetensors
from accel._files.torch_load import load_torch_file
from accel._files.values import dtype_kind, odd_tensor
from accel.errors import CheckpointError, DeviceMapError

__all__ = [
    "DISK",
    "Plan",
    "Source",
    "as_dtype",
    "in_place",
    "plan_load",
    "read_weights",
    "show",
    "stream",
    "where_mapped",
]

DISK = "disk"
Placement = torch.device | str  # a device, or "disk"
Placer = Callable[[str, torch.Tensor], Placement]
Writer = Callable[[str, dict[str, torch.Tensor]], Path]  # (file name, tensors) -> its path
_CPU = torch.device("cpu")
_SHOWN = 8  # names listed in a message


@attrs.frozen
class Stored:
    """One tensor of the checkpoint: the file that holds it, its shape and dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@attrs.frozen
class Slot:
    """One state-dict entry of the model: the module attribute that holds it."""

    module: nn.Module
    attr: str
    is_param: bool
    group: int  # names bound to one tensor object (tied weights) share a group
    tensor: torch.Tensor


@attrs.frozen
class Source:
    """An offloaded tensor's bytes: tensor ``key`` of safetensors file ``path``, cast to
    ``dtype`` (when given) as it is read."""

    path: Path
    key: str
    dtype: torch.dtype | None = None


@attrs.define
class Plan:
    """What :func:`stream` will do, worked out and checked before anything changes."""

    model: nn.Module
    files: list[Path]
    stored: dict[str, Stored]
    slots: dict[str, Slot]
    groups: dict[int, list[str]]  # group -> the model's names for that tensor
    loader: dict[int, str]  # group -> the checkpoint key it is loaded from
    placer: Placer
    placement: dict[str, Placement]
    dtype: torch.dtype | None
    missing: list[str]  # model names nothing in the checkpoint loads (tie-aware)
    unexpected: list[str]  # checkpoint keys the model does not have

    def target_dtype(self, key: str) -> torch.dtype:
        """The dtype ``key`` ends with: ``dtype`` for floating tensors when given, else the
        model's own (as ``load_state_dict`` does)."""
        slot = self.slots[key]
        source = self.loader.get(slot.group)
        if self.dtype is not None and source and self.stored[source].dtype.is_floating_point:
            return self.dtype
        return slot.tensor.dtype

    def left_on_meta(self) -> list[str]:
        """Names that would stay on ``meta`` (the model could not run): tensors missing from
        the checkpoint, and buffers that are not saved, built on ``meta``."""
        left = [k for k in self.missing if self.slots[k].tensor.device.type == "meta"]
        saved = {id(slot.tensor) for slot in self.slots.values()}
        for name, buffer in self.model.named_buffers():
            if buffer.device.type == "meta" and id(buffer) not in saved:
                left.append(name)
        return left

    def to_write(self) -> list[str]:
        """Disk-placed names whose bytes must be written to the offload folder: read from a
        torch file, the model's own value, or an integer cast a mapped source cannot do."""
        out = []
        for key, where in self.placement.items():
            if where != DISK:
                continue
            source = self.loader.get(self.slots[key].group)
            if source is None:
                if self.slots[key].tensor.device.type != "meta":
                    out.append(key)
                continue
            stored = self.stored[source]
            if stored.file.suffix != ".safetensors" or (
                self.target_dtype(key) != stored.dtype and not stored.dtype.is_floating_point
            ):
                out.append(key)
        return out


def show(names: Iterable[str]) -> str:
    """The first few ``names`` for a message, with how many more there are."""
    names = list(names)
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{names[:_SHOWN]!r}{more}"


def warn_unexpected(where: str, unexpected: list[str], *, stacklevel: int) -> None:
    """Say which checkpoint tensors the model has no place for (they were not loaded)."""
    if unexpected:
        warnings.warn(
            f"Checkpoint {where!r} holds tensors the model does not have; they were not "
            f"loaded: {show(unexpected)}.",
            stacklevel=stacklevel + 1,
        )


def as_dtype(value: object) -> torch.dtype | None:
    """``dtype=`` as users give it: a ``torch.dtype``, a name (``"bfloat16"``,
    ``"torch.float16"``) or ``None``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise CheckpointError(
        f"dtype={value!r} is not a torch dtype; pass e.g. `dtype=torch.bfloat16` or "
        "`dtype='float16'`."
    )


def in_place(key: str, tensor: torch.Tensor) -> Placement:
    """Without a device map: a tensor stays on its device; ``meta`` ones go to the CPU."""
    del key
    return _CPU if tensor.device.type == "meta" else tensor.device


def where_mapped(device_map: Mapping[str, Placement]) -> Placer:
    """The placement a normalized device map gives each tensor: its longest prefix in it."""

    def where(key: str, tensor: torch.Tensor) -> Placement:
        del tensor
        name = key
        while name not in device_map:
            if not name:
                raise DeviceMapError(
                    f"The device map gives no device to {key!r}; map it, one of its parent "
                    "modules, or '' (the whole model)."
                )
            name = name.rpartition(".")[0]
        return device_map[name]

    return where


def _refused(path: Path, exc: BaseException) -> CheckpointError:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch's text: a first paragraph that suggests weights_only=False, then the reason
    kept = [line for line in lines[1:] if not line.startswith("Check the documentation")]
    reason = re.sub(r".*WeightsUnpickler error:\s*", "", " ".join(kept)) or type(exc).__name__
    return CheckpointError(
        f"Weights file {os.fspath(path)!r} was refused: torch.load(weights_only=True) cannot "
        f"read it ({reason}). accel reads torch files only when they hold plain tensors, so "
        "no code in a checkpoint ever runs. If the file is corrupted, write it again; if it "
        "holds other objects, save only the state dict (`torch.save(model.state_dict(), "
        "path)`) or convert it to safetensors with a loader you trust."
    )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weights file, by name, as views of a private (copy-on-write) map.

    A ``.safetensors`` file is mapped and its header checked; any other file is read with
    ``torch.load(weights_only=True, mmap=True)`` (a torch file older than the zip format,
    which cannot be mapped, is read whole), after its zip directory is checked (every member
    stored, of the size its ``data.pkl`` declares: a map never reads the wrong bytes).
    Nothing is read until a tensor is used.

    Raises:
        CheckpointError: the file is missing, corrupted, refused, or not a dict of tensors.
    """
    if not path.is_file():
        raise CheckpointError(
            f"Weights file {os.fspath(path)!r} is missing: the checkpoint is incomplete. Copy "
            "or write the whole checkpoint again."
        )
    if path.suffix == ".safetensors":
        return read_safetensors(path)[0]
    loaded = load_torch_file(
        path,
        refused=lambda exc: _refused(path, exc),
        corrupted=lambda exc: CheckpointError(
            f"Weights file {os.fspath(path)!r} is corrupted: {exc}. Write it again."
        ),
    )
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise CheckpointError(
            f"{os.fspath(path)!r} does not hold a state dict (a dict of name -> tensor) but a "
            f"{type(loaded).__name__}. Save `model.state_dict()` itself."
        )
    odd = [f"{k!r} ({odd_tensor(v)})" for k, v in loaded.items() if odd_tensor(v)]
    if odd:
        raise CheckpointError(
            f"{os.fspath(path)!r} holds tensors accel does not load into a model: "
            f"{', '.join(odd[:_SHOWN])}. A weights file holds dense tensors with data; save "
            "`model.state_dict()` of a plain model (`.to_dense()`, `.dequantize()` first)."
        )
    return dict(loaded)


def _scan(files: list[Path]) -> dict[str, Stored]:
    stored: dict[str, Stored] = {}
    for file in files:
        table = {k: Stored(file, tuple(t.shape), t.dtype) for k, t in read_weights(file).items()}
        for key in table.keys() & stored.keys():
            raise CheckpointError(
                f"Tensor {key!r} is stored twice, in {os.fspath(stored[key].file)!r} and "
                f"{os.fspath(file)!r}; a checkpoint holds each tensor once. Remove the stale "
                "file or write the checkpoint again."
            )
        stored.update(table)
    return stored


def _slots(model: nn.Module) -> tuple[dict[str, Slot], dict[int, list[str]]]:
    slots: dict[str, Slot] = {}
    groups: dict[int, list[str]] = {}
    group_of: dict[int, int] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        prefix, _, attr = key.rpartition(".")
        try:
            module: nn.Module | None = model.get_submodule(prefix)
        except AttributeError:
            module = None
        if module is None or not (attr in module._parameters or attr in module._buffers):
            raise CheckpointError(
                f"State-dict entry {key!r} of {type(model).__name__} is not a parameter or "
                "buffer of a submodule (a custom state_dict hook?); streaming loads need "
                "state-dict names that are module attributes. Load it with "
                "`model.load_state_dict(accel.load(path))` instead."
            )
        group = group_of.setdefault(id(tensor), len(group_of))
        groups.setdefault(group, []).append(key)
        slots[key] = Slot(module, attr, attr in module._parameters, group, tensor)
    return slots, groups


def _refuse_integer_data(stored: dict[str, Stored], slots: dict[str, Slot]) -> None:
    """A floating tensor never takes integer data (``F32`` relabelled ``I32``: values ~1e9),
    nor a real one complex data (its imaginary part would be dropped)."""
    refused = {"floating": ("integer", "bool", "complex"), "complex": ("integer", "bool")}
    wrong = [f"{key!r} is {s.dtype} in {os.fspath(s.file)!r}, {slots[key].tensor.dtype} in the "
             "model" for key, s in stored.items() if key in slots and dtype_kind(s.dtype) in
             refused.get(dtype_kind(slots[key].tensor.dtype), ())]
    if wrong:
        raise CheckpointError(
            "The checkpoint holds integer data for floating tensors of the model (or complex "
            f"data for real ones): "
            f"{'; '.join(wrong[:_SHOWN])}. Nothing was loaded. The file is corrupted or was "
            "crafted, or it holds quantized weights: load it into the model it was saved from."
        )


def plan_load(
    model: nn.Module, files: list[Path], *, placer: Placer, dtype: torch.dtype | None
) -> Plan:
    """Read the checkpoint's tensor table (no tensor data) and check it against ``model``.

    ``placer(name, tensor)`` says where each model tensor goes. Tied weights (one tensor
    under several names) are loaded once, from the first of their names the checkpoint has.

    Raises:
        CheckpointError: a file is missing or unreadable, or a tensor's shape differs.
        DeviceMapError: ``placer`` has no place for a tensor.
    """
    stored = _scan(files)
    slots, groups = _slots(model)
    mismatched = [
        f"{key!r} is {list(s.shape)} in {os.fspath(s.file)!r} but "
        f"{list(slots[key].tensor.shape)} in the model"
        for key, s in stored.items()
        if key in slots and s.shape != tuple(slots[key].tensor.shape)
    ]
    if mismatched:
        raise CheckpointError(
            f"The checkpoint does not fit the model: {len(mismatched)} tensor(s) differ in "
            f"shape: {'; '.join(mismatched[:_SHOWN])}. Nothing was loaded. Build the model "
            "with the configuration the checkpoint was saved from."
        )
    _refuse_integer_data(stored, slots)
    loader: dict[int, str] = {}
    for key in stored:
        if key in slots:
            loader.setdefault(slots[key].group, key)
    return Plan(
        model=model,
        files=list(files),
        stored=stored,
        slots=slots,
        groups=groups,
        loader=loader,
        placer=placer,
        placement={k: placer(k, slot.tensor) for k, slot in slots.items()},
        dtype=dtype,
        missing=[k for k, slot in slots.items() if slot.group not in loader],
        unexpected=[k for k in stored if k not in slots],
    )


def _set(plan: Plan, names: list[str], value: torch.Tensor) -> None:
    """Bind ``value`` (one object, so ties stay ties) under every name of a group."""
    old = plan.slots[names[0]].tensor
    param = None
    for name in names:
        slot = plan.slots[name]
        if not slot.is_param:
            slot.module._buffers[slot.attr] = value
            continue
        if param is None:
            kind = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
            param = kind(value, requires_grad=old.requires_grad)
        slot.module._parameters[slot.attr] = param


def _owns(tensor: torch.Tensor, used: set[int]) -> bool:
    """Whether ``tensor`` spans its own storage, not yet given to another group."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != tensor.numel() * tensor.element_size() or storage.data_ptr() in used:
        return False
    used.add(storage.data_ptr())
    return True


def _place(
    plan: Plan, key: str, src: torch.Tensor, where: torch.device, shareable: bool, used: set[int]
) -> None:
    names = plan.groups[plan.slots[key].group]
    old, dtype = plan.slots[key].tensor, plan.target_dtype(key)
    if old.device.type != "meta" and old.device == where and old.dtype == dtype:
        with torch.no_grad():
            old.copy_(src)
        return
    value = src.to(device=where, dtype=dtype)
    if value is src and not (shareable and _owns(src, used)):
        value = src.clone()
    _set(plan, names, value)


def _offload(plan: Plan, key: str) -> None:
    """Put a ``meta`` placeholder of the final dtype under every name of ``key``'s group."""
    names = plan.groups[plan.slots[key].group]
    old, dtype = plan.slots[key].tensor, plan.target_dtype(key)
    if old.device.type != "meta" or old.dtype != dtype:
        _set(plan, names, torch.empty(old.shape, dtype=dtype, device="meta"))


def stream(plan: Plan, *, write: Writer | None = None) -> dict[str, Source]:
    """Load the checkpoint into ``plan.model``, one file at a time; return the sources of
    the tensors placed on disk, by model name.

    ``write(name, tensors)`` stores disk-placed tensors that cannot be mapped where they are
    (:meth:`Plan.to_write`) as a safetensors file and returns its path.

    Raises:
        CheckpointError: a file changed or vanished since :func:`plan_load` read it.
        DeviceMapError: a tensor must be written to disk and there is no ``write``.
    """
    pending = plan.to_write()
    if pending and write is None:
        raise DeviceMapError(
            f"{show(pending)} must be offloaded to disk but there is no offload folder; "
            "pass `offload_folder=...`."
        )
    sources: dict[str, Source] = {}
    writes = set(pending)
    for file in plan.files:
        jobs = [k for g, k in plan.loader.items() if plan.stored[k].file == file]
        if not jobs:
            continue
        places = [plan.placement[k] for k in jobs]
        safe = file.suffix == ".safetensors"
        if safe and all(p == DISK for p in places) and not writes.intersection(jobs):
            for key in jobs:  # nothing of this file is read: it is mapped where it is
                _offload(plan, key)
                _mapped(plan, key, Source(Path(os.path.abspath(file)), key), sources)
            continue
        # CPU tensors may stay views of the file's private map, unless the map also served
        # the offload copy: then they are copied, and the map (and the pages read for the
        # copy) goes away with this file
        shareable = safe or DISK not in places
        tensors = read_weights(file)
        used: set[int] = set()
        to_disk: dict[str, torch.Tensor] = {}
        for key in jobs:
            src = tensors.pop(key, None)
            if src is None or tuple(src.shape) != plan.stored[key].shape or (
                src.dtype != plan.stored[key].dtype
            ):
                raise CheckpointError(
                    f"Weights file {os.fspath(file)!r} changed while it was being loaded "
                    f"({key!r} differs). Load again once it is no longer being written."
                )
            where = plan.placement[key]
            if where != DISK:
                _place(plan, key, src, torch.device(where), shareable=shareable, used=used)
            elif key in writes:
                dtype = plan.target_dtype(key)
                to_disk[key] = src if src.is_floating_point() else src.to(dtype)
                _offload(plan, key)
            else:
                _offload(plan, key)
                _mapped(plan, key, Source(Path(os.path.abspath(file)), key), sources)
            del src
        del tensors
        if to_disk:
            assert write is not None
            path = write(f"{file.name}.safetensors", to_disk)
            for key in to_disk:
                _mapped(plan, key, Source(path, key), sources)
        del to_disk
    own: dict[str, torch.Tensor] = {}
    for key in pending:
        if key not in sources and not any(n in own for n in plan.groups[plan.slots[key].group]):
            own[key] = plan.slots[key].tensor
    if own:  # real tensors the checkpoint lacks, placed on disk: write the model's values
        assert write is not None
        path = write("accel-model-tensors.safetensors", own)
        for key in own:
            _offload(plan, key)
            _mapped(plan, key, Source(path, key), sources)
    _move_unsaved_buffers(plan)
    return sources


def _mapped(plan: Plan, key: str, source: Source, sources: dict[str, Source]) -> None:
    """Record ``source`` for every name of ``key``'s group, with the cast it still needs."""
    stored, dtype = plan.stored.get(source.key), plan.target_dtype(key)
    cast = dtype if stored is not None and stored.dtype != dtype else None
    for name in plan.groups[plan.slots[key].group]:
        sources[name] = Source(source.path, source.key, cast)


def _move_unsaved_buffers(plan: Plan) -> None:
    """Buffers that are not saved (``persistent=False``) follow their module's device."""
    saved = {id(slot.tensor) for slot in plan.slots.values()}
    for module_name, module in plan.model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None or id(buffer) in saved or buffer.device.type == "meta":
                continue
            full = f"{module_name}.{name}" if module_name else name
            where = plan.placer(full, buffer)
            if where != DISK and buffer.device != torch.device(where):
                module._buffers[name] = buffer.to(where)
