"""Values a checkpoint restores have the types the live objects hold, checked before any change.

A checkpoint is input: its JSON and tensor headers may say anything. ``load_state`` (through
:func:`~accel.checkpoint._fit.check_fits`) calls :func:`check_values` for every object before
it changes any, so a value that would only fail later (``"lr": "abc"`` at ``step()``), load as
garbage (integer bits read into a float parameter: weights of ~1e9), or fail half way through
the restore is refused with a :class:`CheckpointError` naming where it is:

* numbers stay numbers (an int where a float lives is fine; a bool or a string is not), and
  finite where the live value is finite (the live ``best = inf`` of ReduceLROnPlateau takes
  any number);
* bools stay bools (or ``None``), strings stay strings, dtypes stay dtypes, containers keep
  their kind (list and tuple alike);
* tensors stay tensors of the same dtype kind (floating, complex, integer, bool): a float
  parameter never takes integer data, nor an integer buffer floating data;
* an optimizer's per-parameter state, where the live optimizer has none yet, is checked
  against the parameter: its parameter-shaped buffers are tensors of the parameter's kind,
  its ``step`` a finite number >= 0.

Where the live object holds ``None`` or a value of a type not listed (a callable, a user
object), anything is accepted: the object's own ``load_state_dict`` judges it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from accel.errors import CheckpointError

__all__ = [
    "PARAM_SHAPED", "check_counter", "check_gradients", "check_recorded", "check_rng",
    "check_values", "dtype_kind", "dtype_names", "odd_tensor",
]

_SHOWN = 6  # problems named in one message
# per-parameter optimizer state that has the parameter's shape and kind
PARAM_SHAPED = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
    "acc_delta", "sum", "ax", "prev", "step_size",
})
_CHOICES = {  # string options a scheduler's load_state_dict acts on at once
    ReduceLROnPlateau: {"mode": ("min", "max"), "threshold_mode": ("rel", "abs")},
}


def dtype_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"complex"``, ``"floating"`` or ``"integer"`` (quantized included)."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def odd_tensor(tensor: torch.Tensor) -> str:
    """What makes ``tensor`` no plain dense tensor with data (``""`` when it is one): a
    torch file may hold meta, sparse, nested or quantized tensors, which no weight takes."""
    if tensor.is_meta:
        return "a meta tensor, without data"
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.layout != torch.strided:
        return f"a tensor of layout {tensor.layout}"
    if tensor.is_quantized:
        return f"a quantized {tensor.dtype} tensor"
    return ""


def dtype_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """What a structure file records of its tensor file: each tensor's dtype, by name."""
    return {key: str(t.dtype).removeprefix("torch.") for key, t in tensors.items()}


def check_recorded(where: str, tensors: Mapping[str, torch.Tensor], recorded: object) -> None:
    """The dtypes a tensor file's header declares are those its structure file recorded.

    ``recorded`` is the structure file's ``dtypes`` (``None`` in checkpoints written before
    accel recorded them: nothing to compare). A header relabelled after the save (``F32`` ->
    ``I32`` reads the same bytes as integers of ~1e9) differs from the record.

    Raises:
        CheckpointError: the record is not a mapping, or a tensor's dtype differs from it.
    """
    if recorded is None:
        return
    found = dtype_names(tensors)
    if isinstance(recorded, Mapping) and dict(recorded) == found:
        return
    table = recorded if isinstance(recorded, Mapping) else {}
    differ = [
        f"{key!r}: {found.get(key, 'absent')} in the header, {table.get(key, 'absent')!s:.20} "
        "recorded"
        for key in list(dict.fromkeys([*found, *table]))
        if found.get(key) != table.get(key)
    ] or [f"the record is {recorded!r:.40}"]
    raise CheckpointError(
        f"Checkpoint file {where!r} declares other dtypes than its structure file recorded at "
        f"save time ({'; '.join(differ[:_SHOWN])}): its header was changed after the save. "
        "The checkpoint is corrupted or was crafted; load an earlier one."
    )


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except (OverflowError, TypeError, ValueError):
        return False


def _show(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return odd_tensor(value) or f"a {value.dtype} tensor"
    return f"{type(value).__name__} {value!r:.40}"


class _Checker:
    """Collects what is wrong in one saved state, each with its place in the state dict."""

    def __init__(self, exact: bool = False) -> None:
        self.problems: list[str] = []
        self.exact = exact  # tensors of the live dtype and shape, sequences of its length

    def wrong(self, path: str, saved: object, wanted: str) -> None:
        self.problems.append(f"{path or '<root>'}: {_show(saved)} where {wanted}")

    def like(self, live: Any, saved: Any, path: str) -> None:
        """``saved`` has the type (and finiteness, dtype kind) of ``live``, recursively."""
        if isinstance(live, bool):
            if not isinstance(saved, bool) and saved is not None:
                self.wrong(path, saved, "the live object holds a bool")
        elif _is_number(live):
            if not _is_number(saved):
                self.wrong(path, saved, "the live object holds a number")
            elif _finite(live) and not _finite(saved):
                self.wrong(path, saved, f"the live object holds the finite {live!r}")
        elif isinstance(live, str):
            if not isinstance(saved, str):
                self.wrong(path, saved, "the live object holds a string")
        elif isinstance(live, torch.Tensor):
            self.tensor(saved, dtype_kind(live.dtype), path, f"a {live.dtype} tensor", live)
            if self.exact and isinstance(saved, torch.Tensor) and (
                saved.dtype != live.dtype or saved.shape != live.shape
            ):
                self.wrong(path, saved, f"a {live.dtype} tensor of shape {tuple(live.shape)} "
                           f"belongs, not one of shape {tuple(saved.shape)}")
        elif isinstance(live, torch.dtype):
            if not isinstance(saved, torch.dtype):
                self.wrong(path, saved, "the live object holds a dtype")
        elif isinstance(live, Mapping):
            if not isinstance(saved, Mapping):
                self.wrong(path, saved, "the live object holds a mapping")
                return
            for key, value in live.items():
                if key in saved:
                    self.like(value, saved[key], f"{path}[{key!r}]")
        elif isinstance(live, list | tuple):
            if not isinstance(saved, list | tuple):
                self.wrong(path, saved, "the live object holds a sequence")
                return
            if self.exact and len(saved) != len(live):
                self.wrong(path, saved, f"a sequence of {len(live)} belongs")
            for index, (a, b) in enumerate(zip(live, saved, strict=False)):
                self.like(a, b, f"{path}[{index}]")

    def tensor(
        self, saved: Any, kind: str, path: str, live: str, like: torch.Tensor | None = None
    ) -> None:
        odd = odd_tensor(saved) if isinstance(saved, torch.Tensor) else "not a tensor"
        if odd and (like is None or odd_tensor(like) != odd):  # meta, sparse... unlike live
            self.wrong(path, saved, f"the live object holds {live}")
        elif dtype_kind(saved.dtype) != kind:
            self.wrong(path, saved, f"the live object holds {live} ({kind} data)")

    def step(self, saved: Any, path: str) -> None:
        """An optimizer's step count: a finite number >= 0, or a one-element such tensor."""
        value = saved
        if isinstance(saved, torch.Tensor):
            if odd_tensor(saved) or saved.numel() != 1 or (
                dtype_kind(saved.dtype) not in ("floating", "integer")
            ):
                self.wrong(path, saved, "a step count (a number) belongs")
                return
            value = saved.item()
        if not _is_number(value) or not _finite(value) or value < 0:
            self.wrong(path, saved, "a step count (a finite number >= 0) belongs")


def _module(checker: _Checker, module: nn.Module, saved: Mapping[str, Any]) -> None:
    for key, value in module.state_dict().items():
        if isinstance(value, torch.Tensor) and key in saved:
            checker.tensor(saved[key], dtype_kind(value.dtype), repr(key), f"a {value.dtype} "
                           "tensor", value)


def _optimizer(checker: _Checker, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return  # check_fits names it
    for number, (own, group) in enumerate(zip(optimizer.param_groups, groups, strict=False)):
        if not isinstance(group, Mapping):
            continue
        plain = {k: v for k, v in own.items() if k != "params"}  # indices: checked by _fit
        checker.like(plain, group, f"['param_groups'][{number}]")
        for index, param in zip(group.get("params", ()), own["params"], strict=False):
            entry = state.get(index)
            if isinstance(entry, Mapping):
                _param_state(checker, optimizer.state.get(param), param, entry,
                             f"['state'][{index!r}]")


def _param_state(
    checker: _Checker, live: Any, param: torch.Tensor, entry: Mapping[str, Any], path: str
) -> None:
    """One parameter's saved state, against the live one or, where none yet, the parameter."""
    for key, value in entry.items():  # the optimizer moves every tensor to its parameter
        if isinstance(value, torch.Tensor) and odd_tensor(value):
            checker.wrong(f"{path}[{key!r}]", value, "a tensor with data belongs")
            return
    if isinstance(live, Mapping) and live:
        checker.like(live, entry, path)
        return
    kind = dtype_kind(param.dtype)
    want = ("floating", "complex") if kind in ("floating", "complex") else (kind,)
    for key, value in entry.items():
        if key == "step":
            checker.step(value, f"{path}['step']")
        elif key in PARAM_SHAPED and (
            not isinstance(value, torch.Tensor) or dtype_kind(value.dtype) not in want
        ):
            checker.wrong(f"{path}[{key!r}]", value,
                          f"a tensor like its {param.dtype} parameter belongs")


def _choices(checker: _Checker, target: Any, saved: Mapping[str, Any]) -> None:
    for cls, options in _CHOICES.items():
        if isinstance(target, cls):
            for key, allowed in options.items():
                if key in saved and saved[key] not in allowed:
                    checker.wrong(f"[{key!r}]", saved[key], f"one of {list(allowed)} belongs")


def _own_attributes(
    checker: _Checker, target: Any, live: Mapping[str, Any], saved: Mapping[str, Any]
) -> None:
    """A scheduler's ``load_state_dict`` sets every saved key as an attribute: a key naming
    one of its methods or its own wiring (``step``, ``optimizer``), which its state dict
    leaves out, would replace it; ``lr_lambdas`` must match the live functions one to one."""
    for key in saved:
        if key in live or not isinstance(key, str):
            continue
        if key.startswith("__") or key in vars(target) or hasattr(type(target), key):
            checker.wrong(f"[{key!r}]", saved[key], "nothing belongs (it would replace the "
                          f"{type(target).__name__}'s own {key!r})")
    lambdas, own = saved.get("lr_lambdas"), live.get("lr_lambdas")
    if isinstance(own, list) and (not isinstance(lambdas, list) or len(lambdas) != len(own)
                                  or not all(f is None or isinstance(f, Mapping) for f in lambdas)):
        checker.wrong("['lr_lambdas']", lambdas, f"a list of {len(own)} function states belongs")


def _raise(name: str, problems: list[str], what: str) -> None:
    if problems:
        more = len(problems) - _SHOWN
        raise CheckpointError(
            f"The checkpoint's {name!r} holds values that {what} cannot take: "
            f"{'; '.join(problems[:_SHOWN])}{f'; and {more} more' if more > 0 else ''}. The "
            "checkpoint is corrupted or was crafted, or it was saved from another kind of "
            "object; nothing was loaded. Load an earlier checkpoint, or pass the object it was "
            "saved from."
        )


def check_values(name: str, target: Any, saved: Any) -> None:
    """Raise :class:`CheckpointError` unless ``saved``'s values fit what ``target`` holds.

    ``target`` is the live (unwrapped) object: a module (dtype kinds of its tensors), an
    optimizer (parameter groups and per-parameter state), a scheduler or a GradScaler (every
    value against the live state dict). Other objects are not checked here. Call it after the
    keys and shapes are checked (:func:`~accel.checkpoint._fit.check_fits`).

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> bad = opt.state_dict(); bad["param_groups"][0]["lr"] = "abc"
        >>> check_values("optimizer", opt, bad)
        Traceback (most recent call last):
        accel.errors.CheckpointError: The checkpoint's 'optimizer' holds values ...
    """
    checker = _Checker()
    if isinstance(target, nn.Module):
        if isinstance(saved, Mapping):
            _module(checker, target, saved)
    elif isinstance(target, torch.optim.Optimizer):
        if isinstance(saved, Mapping):
            _optimizer(checker, target, saved)
    elif isinstance(target, LRScheduler | torch.amp.GradScaler):
        if not isinstance(saved, Mapping):
            checker.wrong("", saved, f"a {type(target).__name__} state dict belongs")
        else:
            live = target.state_dict()
            checker.like(live, saved, "")
            # accel's PreparedScheduler holds the user's scheduler
            _choices(checker, getattr(target, "scheduler", target), saved)
            inner = getattr(target, "scheduler", target)
            if isinstance(inner, LRScheduler | ReduceLROnPlateau):  # they __dict__.update()
                _own_attributes(checker, inner, live, saved)
            else:  # the GradScaler reads each of its keys
                for key in live:
                    if key not in saved:
                        checker.wrong(f"[{key!r}]", None, f"a {type(live[key]).__name__} "
                                      "belongs (the GradScaler reads it)")
    _raise(name, checker.problems, f"the {type(target).__name__} passed as {name}=")


def check_rng(name: str, live: Mapping[str, Any], saved: Any) -> None:
    """``saved`` RNG states have the structure, dtypes and shapes of ``live`` ones.

    ``live`` is what :func:`~accel.checkpoint.rng.get_rng_state` returns now. Generators the
    checkpoint lacks, or holds for another number of devices, are left alone on restore.
    """
    checker = _Checker(exact=True)
    if not isinstance(saved, Mapping):
        checker.wrong("", saved, "a mapping of generator states belongs")
    else:
        checker.like({k: v for k, v in live.items() if k != "cuda"}, saved, "")
        _mersenne(checker, saved.get("python"), "state", 625, "['python']")
        _mersenne(checker, saved.get("numpy"), "pos", 1, "['numpy']")
        for key, place in (("python", "gauss"), ("numpy", "cached_gaussian")):
            value = saved.get(key, {}).get(place) if isinstance(saved.get(key), Mapping) else None
            if value is not None and not (_is_number(value) and _finite(value)):
                checker.wrong(f"[{key!r}][{place!r}]", value, "None or a finite number belongs")
        version = saved.get("python", {}).get("version") if isinstance(
            saved.get("python"), Mapping) else None
        if "python" in saved and version != live["python"]["version"]:
            checker.wrong("['python']['version']", version,
                          f"{live['python']['version']!r} belongs")
        if "numpy" in live and isinstance(saved.get("numpy"), Mapping):
            kind = saved["numpy"].get("kind")
            if kind != live["numpy"]["kind"]:
                checker.wrong("['numpy']['kind']", kind, f"{live['numpy']['kind']!r} belongs")
    _raise(name, checker.problems, "this process's random number generators")


def _mersenne(checker: _Checker, state: Any, key: str, count: int, path: str) -> None:
    """A Mersenne Twister state: words < 2**32 and a position in 0..624 (as the last value)."""
    value = state.get(key) if isinstance(state, Mapping) else None
    if isinstance(value, torch.Tensor) and value.numel() == count and count > 1:
        words, position = value[:-1], int(value[-1])
        if bool(((words < 0) | (words >= 2**32)).any()) or not 0 <= position <= 624:
            checker.wrong(f"{path}[{key!r}]", value, "a Mersenne Twister state belongs")
    elif _is_number(value) and not 0 <= value <= 624:  # type: ignore[operator]
        checker.wrong(f"{path}[{key!r}]", value, "a position in 0..624 belongs")


def check_counter(name: str, value: Any) -> None:
    """An accumulation counter restored with ``name``: ``None`` or an int >= 0."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        _raise(name, [f"['accumulation_step']: {_show(value)} where an int >= 0 belongs"],
               "the gradient accumulation counter")


def check_gradients(name: str, file: str, module: nn.Module, saved: Any) -> None:
    """Mid-cycle gradients: a tensor of each named parameter's shape and dtype kind."""
    checker = _Checker()
    params = dict(module.named_parameters())
    if not isinstance(saved, Mapping):
        checker.wrong("", saved, "a mapping of parameter names to gradients belongs")
    else:
        for key, grad in saved.items():
            param = params.get(key)
            if param is None:
                checker.wrong(repr(key), grad, "no parameter of that name exists")
                continue
            checker.tensor(grad, dtype_kind(param.dtype), repr(key), f"a {param.dtype} "
                           "parameter")
            if isinstance(grad, torch.Tensor) and grad.shape != param.shape:
                checker.wrong(repr(key), grad, f"a gradient of shape {tuple(param.shape)} "
                              "belongs")
    _raise(file, checker.problems, f"the model passed as {name}=")
