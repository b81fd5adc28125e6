"""Reading checkpoints written by HuggingFace Accelerate's ``Accelerator.save_state``.

Accelerate writes one directory holding, by kind and in registration order (the first object
of a kind has no number, the second ``_1``, ...)::

    model.safetensors  model_1.safetensors        # or pytorch_model.bin, pytorch_model_1.bin
    optimizer.bin  optimizer_1.bin                # torch.save of state dicts
    scheduler.bin  scheduler_1.bin
    sampler.bin  dl_state_dict.bin                # data loaders (only in some configurations)
    scaler.pt                                     # the fp16 GradScaler
    random_states_0.pkl  random_states_1.pkl ...  # one per process: pickled RNG states
    custom_checkpoint_0.pkl ...                   # objects given to register_for_checkpointing

accel maps the objects given to ``load_state`` to these files by kind, in the order of the
keywords of the call (the first model is ``model``, the second ``model_1``, ...). Everything is
read with ``torch.load(weights_only=True)`` or as safetensors; the ``.pkl`` files are never
opened. ``sampler.bin`` holds a pickled ``SeedableRandomSampler`` *object*: it is read with the
weights-only unpickler, every class it names replaced by an inert stand-in that only records
its fields (no code of the checkpoint's classes runs), and only its ``epoch`` is used.

This module finds such a directory and reads it into plain states, checking each one with the
check ``load_state`` passes before the next file is read; ``load_state`` then agrees on it over
the ranks and puts the states into its objects.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader

from accel._files.torch_load import load_torch_file
from accel._files.torch_pickle import InertObject, check_loaded, inert_globals
from accel._files.torch_zip import opened_torch_file
from accel.core.scope import scope
from accel.errors import CheckpointError
from accel.weights.stream import read_weights

__all__ = ["AccelerateRead", "Check", "describe_found", "is_accelerate", "read_accelerate"]

Check = Callable[[str, Any, Any], None]
"""``check(name, obj, state)``: raises a :class:`CheckpointError` when ``state`` cannot load into
``obj`` (``load_state`` passes its check of keys, shapes and value types)."""

_SAMPLER_CLASS = "accelerate.data_loader.SeedableRandomSampler"
_SCALER = "scaler.pt"
# accel's own checkpoint: its manifest (accel.checkpoint.layout.MANIFEST, named here since
# this package imports none of accel.checkpoint's modules)
_ACCEL_MANIFEST = "manifest.json"
_ACCEL_RANK_FILE = "rng_rank0.json"  # every accel save_state writes it
_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
_CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
_KNOWN = re.compile(
    r"^(?:(?:model|pytorch_model)(?:_\d+)?\.(?:safetensors|bin)"
    r"|(?:optimizer|scheduler|sampler|dl_state_dict)(?:_\d+)?\.bin"
    r"|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)
# FSDP and DeepSpeed save_state write sharded directories accel does not read.
_SHARDED = re.compile(r"^(?:pytorch_model_fsdp(?:_\d+)?|optimizer_\d+|pytorch_model(?:_\d+)?)$")


@attrs.frozen
class AccelerateRead:
    """What one rank read and checked of an Accelerate directory, ready to apply.

    ``states`` holds each object's state by name and ``scaler`` the GradScaler's (or ``None``);
    ``used`` names the files read, ``refused`` the pickles never opened (``rng_refused``: RNG
    states among them), ``unused`` the directory's other entries; ``world_size`` is the number
    of ``random_states_N.pkl`` files (1 when there is none).

    Example:
        >>> read_accelerate(Path("acc_ckpt"), {"model": model}, check=check_fits).used
        ('model.safetensors',)
    """

    states: dict[str, Any]
    scaler: Any
    used: tuple[str, ...]
    refused: tuple[str, ...]
    unused: tuple[str, ...]
    rng_refused: bool
    world_size: int


def _entries(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def is_accelerate(path: Path) -> bool:
    """Whether ``path`` is a directory laid out by Accelerate (and not an accel checkpoint).

    Example:
        >>> is_accelerate(Path("accelerate_ckpt/checkpoint_0"))
        True
    """
    if not path.is_dir() or (path / _ACCEL_MANIFEST).exists() or (
            path / _ACCEL_RANK_FILE).exists():
        return False  # accel's own (complete or not): load_state's own checks handle it
    return any(_KNOWN.match(name) or _SHARDED.match(name) for name in _entries(path))


def describe_found(directory: Path) -> str:
    """What ``directory`` holds, for the error of a directory that is no checkpoint at all.

    Example:
        >>> describe_found(Path("notes"))
        " (it holds ['a.txt']: neither an accel checkpoint (manifest.json) nor ..."
    """
    if not os.path.lexists(directory):
        return " (it does not exist)"
    if not directory.is_dir():
        return " (it is a file, not a directory)"
    names = _entries(directory)
    if not names:
        return " (it is an empty directory)"
    shown = names[:8] + ([f"... {len(names) - 8} more"] if len(names) > 8 else [])
    return (
        f" (it holds {shown}: neither an accel checkpoint (manifest.json), nor one written by "
        "Accelerate's save_state (model.safetensors, optimizer.bin, random_states_0.pkl, ...), "
        "nor by DeepSpeed's save_checkpoint (latest, TAG/*model_states.pt))"
    )


def _kind(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, LRScheduler | ReduceLROnPlateau):
        return "scheduler"
    if isinstance(obj, DataLoader):
        return "dataloader"
    if isinstance(obj, torch.amp.GradScaler):
        return "scaler"
    return "custom"


def _numbered(stem: str, index: int, suffix: str) -> str:
    return f"{stem}{'' if index == 0 else f'_{index}'}{suffix}"


def _torch_file(path: Path, name: str) -> Any:
    """``torch.load(weights_only=True)`` of one file, errors as :class:`CheckpointError`."""

    def refused(exc: pickle.UnpicklingError) -> CheckpointError:
        flat = " ".join(str(exc).split())
        reason = re.sub(r".*WeightsUnpickler error:\s*", "", flat).split(" Check the doc")[0]
        return CheckpointError(
            f"{os.fspath(path)!r} (the state of {name}=) was refused: torch.load("
            f"weights_only=True) cannot read it ({reason}). accel never unpickles "
            "checkpoint files; re-save that object's `state_dict()` holding only tensors and "
            "plain values."
        )

    def corrupted(exc: Exception) -> CheckpointError:
        return CheckpointError(
            f"{os.fspath(path)!r} (the state of {name}=) is corrupted or unreadable "
            f"({type(exc).__name__}: {exc}). Copy or write the checkpoint again."
        )

    loaded = load_torch_file(path, refused=refused, corrupted=corrupted)
    check_loaded(loaded, lambda what: CheckpointError(  # before anything walks it
        f"{os.fspath(path)!r} (the state of {name}=) is refused: it {what}, which no state "
        "dict does. The file is corrupted or was crafted; write it again."
    ))
    return loaded


def _missing(path: Path, name: str, what: str, fix: str) -> CheckpointError:
    return CheckpointError(
        f"The Accelerate checkpoint at {os.fspath(path)!r} has no {what} for {name}= "
        f"(it holds {_entries(path)}). {fix}"
    )


_ORDER_FIX = (
    "Objects are matched to Accelerate's files by kind, in the order of the keywords: the "
    "first model is model.*, the second model_1.*; pass them in the order they were "
    "prepared with Accelerate, or leave this one out."
)


def _match_model_keys(saved: dict[str, torch.Tensor], module: nn.Module) -> dict[str, Any]:
    """Accelerate's keys for ``module``: wrapper prefixes removed, shared tensors filled in.

    ``save_state`` of a DDP or compiled model saves ``module.``/``_orig_mod.`` keys, and its
    safetensors files keep one name of tensors shared by several (tied weights).
    """
    own = module.state_dict()
    for prefix in ("module.", "_orig_mod."):
        if (saved and all(k.startswith(prefix) for k in saved)
                and not all(k.startswith(prefix) for k in own)):
            saved = {k[len(prefix):]: v for k, v in saved.items()}
    result: dict[str, Any] = dict(saved)
    for key, tensor in own.items():
        if key in result or tensor.data_ptr() == 0:
            continue
        twin = next(
            (other for other, t in own.items() if other in saved and t.data_ptr()
             == tensor.data_ptr() and t.shape == tensor.shape), None,
        )
        if twin is not None:
            result[key] = saved[twin]
    return result


def _read_model(
    path: Path, name: str, index: int, module: nn.Module, check: Check
) -> tuple[Any, str]:
    for file in (_numbered("model", index, ".safetensors"), _numbered("pytorch_model", index,
                                                                      ".bin")):
        if (path / file).is_file():
            saved = _match_model_keys(read_weights(path / file), module)
            check(name, module, saved)
            return saved, file
    sharded = [n for n in _entries(path) if _SHARDED.match(n)]
    fix = (f"It holds {sharded}: a sharded FSDP/DeepSpeed save, which accel does not read; "
           "save the full model with Accelerate (`accelerator.save_model`) and load it with "
           "`accel.load_checkpoint_in_model`." if sharded else _ORDER_FIX)
    raise _missing(path, name, f"{_numbered('model', index, '.safetensors')} or "
                   f"{_numbered('pytorch_model', index, '.bin')}", fix)


def _read_sampler(path: Path, file: str, name: str) -> int:
    """The ``epoch`` of the ``SeedableRandomSampler`` pickled in ``file``, read inertly."""
    where = path / file
    try:
        with opened_torch_file(where) as (opened, _):  # a zip is checked before torch reads it
            names = torch.serialization.get_unsafe_globals_in_checkpoint(opened)
            stand_ins = inert_globals(names)
            opened.seek(0)
            with torch.serialization.safe_globals(stand_ins):
                loaded = torch.load(opened, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{os.fspath(where)!r} (the sampler of {name}=) could not be read without running "
            f"its code ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}). Leave {name}= "
            f"out and resume it with `accel.skip_first_batches(loader, n, epoch=e)`."
        ) from None
    fields = loaded.__dict__.get("_state") if isinstance(loaded, InertObject) else None
    epoch = fields.get("epoch") if isinstance(fields, dict) else None
    if getattr(loaded, "qualname", None) != _SAMPLER_CLASS or not (
        isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0
    ):
        raise CheckpointError(
            f"{os.fspath(where)!r} (the sampler of {name}=) does not hold an Accelerate "
            f"{_SAMPLER_CLASS} with an integer epoch >= 0 (got {type(loaded).__name__} "
            f"{getattr(loaded, 'qualname', '')!r}, epoch {epoch!r:.40}). Leave {name}= out and "
            "resume it with `accel.skip_first_batches(loader, n, epoch=e)`."
        )
    return epoch


def _read_loader(path: Path, name: str, index: int, loader: Any) -> tuple[Any, list[str]]:
    """The state to give ``loader.load_state_dict``, and the files it came from."""
    from accel.data import PreparedDataLoader

    sampler, stateful = _numbered("sampler", index, ".bin"), _numbered("dl_state_dict", index,
                                                                        ".bin")
    files = [f for f in (sampler, stateful) if (path / f).is_file()]
    if not files:
        raise _missing(
            path, name, f"{sampler} or {stateful}",
            "Accelerate saves a data loader's position only with use_stateful_dataloader=True "
            f"({stateful}) or for a seedable sampler of an iterable dataset ({sampler}). Leave "
            f"{name}= out and resume the loader with `accel.skip_first_batches(loader, "
            "num_batches, epoch=epoch)`.",
        )
    epoch = _read_sampler(path, sampler, name) if sampler in files else None
    raw = _torch_file(path / stateful, name) if stateful in files else None
    if raw is not None and not isinstance(loader, PreparedDataLoader):
        return raw, files  # a StatefulDataLoader reads its own state dict
    if not isinstance(loader, PreparedDataLoader):
        raise CheckpointError(
            f"{os.fspath(path / sampler)!r} holds a sampler epoch, which accel restores only "
            f"into a data loader made by `accel.prepare_data_loader`; {name}= is a "
            f"{type(loader).__name__}. Prepare it first."
        )
    current = loader.state_dict().get("epoch")
    start = epoch if epoch is not None else current if isinstance(current, int) else 0
    position = {"epoch": start, "batches_yielded": 0}
    if raw is not None:
        yielded = raw.get("_num_yielded") if isinstance(raw, Mapping) else None
        if not isinstance(yielded, int) or isinstance(yielded, bool) or yielded < 0:
            raise CheckpointError(
                f"{os.fspath(path / stateful)!r} (the state of {name}=) has no non-negative "
                f"'_num_yielded' (got {yielded!r}); it is not a StatefulDataLoader state. "
                f"Leave {name}= out and resume it with `accel.skip_first_batches`."
            )
        if raw.get("_iterator_finished") is True:
            position["epoch"] += 1
        else:
            position["batches_yielded"] = yielded
    return position, files


def _read_one(
    path: Path, name: str, kind: str, index: int, obj: Any, check: Check
) -> tuple[Any, list[str]]:
    if kind == "model":
        saved, file = _read_model(path, name, index, obj, check)
        return saved, [file]
    if kind == "dataloader":
        return _read_loader(path, name, index, obj)
    if kind == "custom":
        file = f"custom_checkpoint_{index}.pkl"
        found = f"is {file}" if (path / file).exists() else f"would be {file} (it is absent)"
        raise CheckpointError(
            f"{name}= ({type(obj).__name__}) cannot be restored from the Accelerate checkpoint "
            f"at {os.fspath(path)!r}: its state {found}, a pickle, which accel never opens (it "
            f"could run code). If you trust the file, load it yourself: `{name}.load_state_dict("
            f"torch.load('{os.fspath(path / file)}', weights_only=True))`, and leave {name}= "
            "out of load_state."
        )
    file = _SCALER if kind == "scaler" else _numbered(kind, index, ".bin")
    if not (path / file).is_file():
        raise _missing(path, name, file, _ORDER_FIX)
    saved = _torch_file(path / file, name)
    check(name, obj, saved)
    return saved, [file]


def read_accelerate(path: Path, objects: dict[str, Any], *, check: Check) -> AccelerateRead:
    """Read and check every file of the Accelerate directory ``path`` this rank needs; change
    nothing.

    ``objects`` are the live objects by name, in the order of ``load_state``'s keywords,
    models unwrapped (their keys are matched to the saved ones). Each state is given to
    ``check`` as soon as it is read, before the next file is.

    Raises:
        CheckpointError: a requested object has no file or its state lives in a pickle, a file
            is refused, or ``check`` refused a state.

    Example:
        >>> read_accelerate(Path("acc_ckpt"), {"model": model}, check=check_fits).states.keys()
        dict_keys(['model'])
    """
    counts: dict[str, int] = {}
    states: dict[str, Any] = {}
    used: list[str] = []
    kinds = {name: _kind(obj) for name, obj in objects.items()}
    for name, obj in objects.items():
        kind = kinds[name]
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        try:
            states[name], files = _read_one(path, name, kind, index, obj, check)
        except CheckpointError as exc:
            if list(kinds.values()).count(kind) < 2 or _ORDER_FIX in str(exc):
                raise
            raise CheckpointError(f"{exc} {_ORDER_FIX}") from None
        used += files
    scaler = None
    if scope().grad_scaler is not None and "scaler" not in counts and (path / _SCALER).is_file():
        scaler = _torch_file(path / _SCALER, "the GradScaler")
        used.append(_SCALER)
    names = _entries(path)
    refused = tuple(n for n in names if _RNG.match(n) or _CUSTOM.match(n))
    ranks = [int(m.group(1)) for n in names if (m := _RNG.match(n))]
    unused = tuple(n for n in names if n not in used and n not in refused)
    return AccelerateRead(
        states=states, scaler=scaler, used=tuple(used), refused=refused, unused=unused,
        rng_refused=any(_RNG.match(n) for n in refused), world_size=max(ranks, default=0) + 1,
    )

