"""``load_state`` of DeepSpeed's own checkpoint directories (``engine.save_checkpoint``).

A directory without accel's manifest that DeepSpeed wrote (its root holding ``latest``, or one
tag's directory) is read by :mod:`accel.checkpoint.foreign.deepspeed_params` into the state one
plain process's objects hold, and loaded through the path accel's own checkpoints take
(:func:`~accel.checkpoint.sharded.reshard.resolve`, :func:`~accel.checkpoint._fit.check_fits`,
:func:`~accel.checkpoint._loading.load_into`), so it resumes one plain process, DDP, FSDP2 or
DeepSpeed through accel at any world size:

* the model (the first ``nn.Module`` given): the fp32 master weights, buffers as saved, tied
  names filled in;
* the optimizer (the first one given): per parameter, by name, the elementwise state
  (``exp_avg``, ``exp_avg_sq``...) and the step count, the groups' hyper-parameters (``lr``,
  ``betas``...: those the live optimizer's groups hold);
* the LR scheduler (the first one given), from the ``lr_scheduler`` DeepSpeed saved when the
  engine held one.

DeepSpeed's directory holds nothing else accel restores: RNG states, data loader positions,
a GradScaler's scale, other objects and the script's ``client_state`` are left as they are,
named in one warning. ``CheckpointInfo.step`` is DeepSpeed's ``global_steps``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from accel.checkpoint._agreement import agreed_target
from accel.checkpoint._fit import check_fits
from accel.checkpoint._loading import CheckpointInfo, load_into
from accel.checkpoint._saving import unwrap
from accel.checkpoint.foreign.deepspeed_files import is_deepspeed
from accel.checkpoint.foreign.deepspeed_params import (
    DeepSpeedTag,
    optimizer_state,
    read_tag,
    weights,
)
from accel.checkpoint.layout import MANIFEST
from accel.checkpoint.sharded.reshard import resolve
from accel.comm.failures import agree_on_failure
from accel.core.scope import scope
from accel.errors import CheckpointError
from accel.weights.ties import PARAM_NAMES, TIED

__all__ = ["DeepSpeedCheckpointInfo", "load_deepspeed_state"]

# hyper-parameters that tell torch's optimizers apart (Adam's betas, SGD's momentum...)
_KIND_KEYS = frozenset({
    "betas", "momentum", "dampening", "nesterov", "alpha", "centered", "rho", "lr_decay",
    "initial_accumulator_value", "etas", "step_sizes", "lambd", "t0", "momentum_decay",
})


@attrs.frozen
class DeepSpeedCheckpointInfo(CheckpointInfo):
    """A :class:`CheckpointInfo` for a directory DeepSpeed's ``save_checkpoint`` wrote.

    ``path`` is the tag's directory, ``step`` DeepSpeed's ``global_steps``, ``world_size``
    the number of ranks it was saved by, ``objects`` the names restored; ``not_restored``
    says what was not (as the warning does).

    Example:
        >>> accel.load_state("ds_ckpt", model=model, optimizer=optimizer).zero_stage
        2
    """

    zero_stage: int = 0
    global_samples: int | None = None
    skipped_steps: int | None = None
    not_restored: tuple[str, ...] = ()


@attrs.frozen
class _Read:
    """What one rank read and checked, ready to apply."""

    tag: DeepSpeedTag
    states: dict[str, Any]
    not_restored: tuple[str, ...]


def _kind(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer) or isinstance(
            getattr(obj, "param_groups", None), list):
        return "optimizer"
    if isinstance(obj, LRScheduler | ReduceLROnPlateau) or isinstance(
            getattr(obj, "scheduler", None), LRScheduler | ReduceLROnPlateau):
        return "scheduler"
    return "other"


def _one_each(where: Path, objects: dict[str, Any]) -> dict[str, str]:
    """The object given for each kind DeepSpeed's directory holds one of.

    Raises:
        CheckpointError: two models or two optimizers (a DeepSpeed engine has one of each).
    """
    chosen: dict[str, str] = {}
    for name, obj in objects.items():
        kind = _kind(obj)
        if kind in chosen and kind != "other":
            raise CheckpointError(
                f"The DeepSpeed checkpoint {os.fspath(where)!r} holds one {kind} (one engine); "
                f"load_state was given two: {chosen[kind]}= and {name}=. Pass the {kind} of "
                "the engine that saved it, and restore the other one from its own checkpoint."
            )
        if kind != "other":
            chosen[kind] = name
    return chosen


def _groups(name: str, target: Any, saved: dict[str, Any], hyper_saved: bool) -> dict[str, Any]:
    """``saved`` with each group's hyper-parameters those of the live group: the saved value
    where DeepSpeed's optimizer had it, the live one where not.

    Raises:
        CheckpointError: the saved groups are those of another kind of optimizer.
    """
    live = getattr(target, "param_groups", None)
    if not isinstance(live, list) or len(live) != len(saved["param_groups"]):
        return saved  # check_fits says what does not fit
    groups = []
    for number, (group, own) in enumerate(zip(saved["param_groups"], live, strict=True)):
        mine = {k: v for k, v in own.items() if k not in ("params", "param_names")}
        theirs = {k for k in group if k != "params"}
        if hyper_saved and (theirs & _KIND_KEYS) != (set(mine) & _KIND_KEYS):
            raise CheckpointError(
                f"The DeepSpeed checkpoint's optimizer is of another kind than {name}= "
                f"({type(target).__name__}): its group {number} has the hyper-parameters "
                f"{sorted(theirs)}, {name}='s {sorted(mine)}. Create the optimizer the "
                "DeepSpeed run used (e.g. torch.optim.AdamW for Adam's exp_avg/exp_avg_sq), or "
                f"leave {name}= out of load_state."
            )
        kept = {k: group[k] for k in mine if k in group and k != "step"}
        groups.append({**mine, **kept, "params": group["params"]})
    return {**saved, "param_groups": groups}


def _read(directory: Path, objects: dict[str, Any]) -> _Read:
    """Read and check everything; change nothing."""
    read = read_tag(directory, None)
    chosen = _one_each(read.tag, objects)
    states: dict[str, Any] = {}
    loaded: dict[str, tuple[Any, dict[str, Any]]] = {}
    not_restored: list[str] = []
    extra: dict[str, Any] = {TIED: dict(read.states.shared)} if read.states.shared else {}
    if "model" in chosen:
        loaded[chosen["model"]] = (weights(read), dict(extra))
    if "optimizer" in chosen:
        name = chosen["optimizer"]
        found = optimizer_state(read)
        saved = _groups(name, unwrap(objects[name]), found.state_dict, found.hyper_saved)
        loaded[name] = (saved, {**extra, PARAM_NAMES: found.names})
        if not found.hyper_saved:
            not_restored.append(f"{name}='s hyper-parameters (lr...: an elastic checkpoint "
                                "keeps none; the live ones are kept)")
    if "scheduler" in chosen:
        name = chosen["scheduler"]
        if isinstance(read.states.scheduler, Mapping):
            loaded[name] = (dict(read.states.scheduler), {})
        else:
            not_restored.append(f"{name}= (the engine had no LR scheduler: DeepSpeed saved none)")
    given = {n: objects[n] for n in loaded}
    resolve(read.tag, {}, given, loaded)  # ties, FSDP shards, optimizer keys by name
    for name, (state, _) in loaded.items():
        check_fits(name, unwrap(objects[name]), state)
        states[name] = state
    others = [n for n in objects if n not in loaded and n not in chosen.values()]
    if others:
        not_restored.append(f"{', '.join(n + '=' for n in others)} (DeepSpeed's directory "
                            "holds no state for them: data loader positions and other objects "
                            "are not saved by save_checkpoint)")
    not_restored.append("the RNG states (DeepSpeed does not save them; call accel.set_seed)")
    if scope().grad_scaler is not None:
        not_restored.append("the GradScaler's scale (DeepSpeed's loss scaler is its own)")
    if read.states.client_keys:
        not_restored.append(f"the script's client_state {list(read.states.client_keys)[:8]} "
                            "(no object of load_state holds it)")
    return _Read(read, states, tuple(not_restored))


def _target(directory: Path, names: list[str]) -> Path | None:
    if names or (directory / MANIFEST).exists():
        return None  # accel's own checkpoint (or root): load_state's own path
    return directory if is_deepspeed(directory) else None


def load_deepspeed_state(
    directory: Path, names: list[str], objects: dict[str, Any]
) -> CheckpointInfo | None:
    """Load a DeepSpeed ``save_checkpoint`` directory into ``objects``, or ``None`` if
    ``directory`` is none.

    Every rank must call it, with the candidates ``load_state`` agreed on (``names``: a
    DeepSpeed directory holds none). ``directory`` is the root DeepSpeed saved under (its
    ``latest`` tag is loaded) or one tag's directory. Every rank reads and checks every file
    before any object changes, and a failure on one rank is raised on all. One warning names
    what the directory could not restore.

    Raises:
        CheckpointError: the ranks see different directories, a file is missing, corrupted or
            refused, its optimizer state is not one value per weight (not Adam-like) or of
            another kind of optimizer, two models or optimizers were given, or a state does
            not fit its object.

    Example:
        >>> load_deepspeed_state(Path("ds_ckpt"), [], {"model": model, "optimizer": opt})
        DeepSpeedCheckpointInfo(path=PosixPath('ds_ckpt/global_step3'), step=3, ...)
    """
    target = agreed_target(directory, _target(directory, names), "DeepSpeed")  # every rank
    if target is None:
        return None
    where = os.fspath(directory)
    with agree_on_failure(lambda errors: CheckpointError(
        f"load_state({where!r}) cannot load the DeepSpeed checkpoint there: {errors}"
    )):
        read = _read(target, objects)
    with agree_on_failure(lambda errors: CheckpointError(
        f"load_state({where!r}) failed while restoring the DeepSpeed checkpoint at "
        f"{os.fspath(read.tag.tag)!r}: {errors}"
    )):
        for name, state in read.states.items():
            load_into(name, objects[name], state)
    info = read.tag.states.info
    warnings.warn(
        f"load_state({where!r}) restored DeepSpeed's checkpoint {read.tag.tag.name!r} (ZeRO-"
        f"{read.tag.stage} on {read.tag.world_size} rank(s)): "
        f"{', '.join(n + '=' for n in read.states) or 'nothing'}; not restored: "
        f"{'; '.join(read.not_restored)}.",
        stacklevel=3,
    )
    return DeepSpeedCheckpointInfo(
        path=read.tag.tag, step=info["global_steps"], world_size=read.tag.world_size,
        objects=tuple(read.states), zero_stage=read.tag.stage,
        global_samples=info["global_samples"], skipped_steps=info["skipped_steps"],
        not_restored=read.not_restored,
    )
