"""Reading the files of DeepSpeed's own checkpoint directories (``engine.save_checkpoint``),
running no pickle.

DeepSpeed writes, under ``save_dir``::

    latest                                              # text: the tag of the newest save
    TAG/mp_rank_00_model_states.pt                      # ZeRO 0-2: the module state in full
    TAG/zero_pp_rank_R_mp_rank_00_model_states.pt       # ZeRO-3: one per rank (params empty)
    TAG/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt  # ZeRO 1-3: each rank's partition

The model states hold ``module`` (the state dict, in the engine's compute dtype; under ZeRO-3
each parameter is an empty placeholder), ``param_shapes`` (per flat group, the trainable
parameters in flattening order), ``buffer_names``, ``shared_params`` (tied names -> the name
they share), the frozen parameters, ``lr_scheduler`` (the scheduler's state dict, when the
engine had one), the step counters (``global_steps``...) and the ``client_state`` the script
passed, merged in at the top level. The optimizer states hold each rank's slice of the fp32
master weights (ZeRO 1/2 ``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_flat_groups``) and
``base_optimizer_state``: the torch optimizer's state dict over those flat slices (or, with
ZeRO-1/2's ``elastic_checkpoint``, one state per group without its padding).
:mod:`accel.checkpoint.foreign.deepspeed_params` puts them back together per parameter.

The directory is read with the rules of accel's own checkpoints: no symbolic link is followed
anywhere inside it (the ``latest`` file, the tag's directory, every shard file: each is refused
with a :class:`~accel.errors.CheckpointError` naming the link and its target), and only regular
files are opened. Every file is checked as accel's other torch readers check one
(:func:`accel._files.torch_zip.opened_torch_file`: zip structure, storage sizes, a pickle that
builds no more than the file holds, each tensor charged its full logical size, so stride-0
views cannot make a load or a merge allocate gigabytes from a few KB). DeepSpeed's pickles
name classes that ``torch.load(weights_only=True)`` refuses (``LossScaler``, ``ZeroStageEnum``,
``fragment_address``, ``argparse.Namespace``): each one the file names is allowed under that
name as an inert stand-in that only records its arguments, so no code of the checkpoint runs;
a file naming any other global (``os.system``, ``builtins.eval``...) is refused before it is
loaded. Tensors are memory-mapped: only what is used is read.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from accel._files.safe_io import read_bounded, refuse_link
from accel._files.torch_pickle import InertObject, check_loaded, inert_globals
from accel._files.torch_zip import is_zip, opened_torch_file
from accel.errors import CheckpointError

__all__ = [
    "LATEST", "MODEL_FILE", "OPTIM_FILE", "ModelStates", "OptimStates", "bad", "as_int",
    "is_deepspeed", "load_file", "model_states", "optim_states", "rank_files", "tag_dir",
]

LATEST = "latest"
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ALLOWED_PREFIXES = ("deepspeed.",)  # DeepSpeed's own classes: loss scaler, stage enum, ...
_ALLOWED = frozenset({"argparse.Namespace"})  # the launcher's args some engines save
_MAX_TAG = 255
# What DeepSpeed's engine writes into the model states; any other top-level key is the
# script's ``client_state``.
ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "universal_checkpoint_info",
    "tp_world_size", "pp_world_size", "ep_world_size", "sp_world_size",
})


def _owns_model_states(path: Path) -> bool:
    try:
        return any(MODEL_FILE.match(name) for name in os.listdir(path))
    except OSError:
        return False


def _has_latest(path: Path) -> bool:
    """Whether ``path`` holds a ``latest`` file (or a link there, which reading refuses)."""
    latest = path / LATEST
    return latest.is_symlink() or latest.is_file()


def is_deepspeed(path: Path) -> bool:
    """Whether ``path`` is a directory written by DeepSpeed's ``save_checkpoint``: its root
    (holding ``latest``) or one tag's directory (holding ``*model_states.pt``).

    Example:
        >>> is_deepspeed(Path("ds_ckpt"))
        True
    """
    if not path.is_dir():
        return False
    return _has_latest(path) or _owns_model_states(path)


def bad(where: Path | str, what: str) -> CheckpointError:
    """The error of a DeepSpeed directory accel cannot read: where, what, and the way out."""
    return CheckpointError(
        f"{os.fspath(where)!r} is not a DeepSpeed checkpoint accel reads: {what}. Save it "
        "again with engine.save_checkpoint, or use accel.save_state."
    )


def tag_dir(path: Path, wanted: str | None) -> Path:
    """The tag directory to read: ``path`` itself when it holds model states, else the tag
    ``wanted`` or the one ``latest`` names.

    Raises:
        CheckpointError: no such tag, ``latest`` unreadable or not naming a directory, or
            ``latest`` or the tag a symbolic link (never followed: named with its target).
    """
    if _owns_model_states(path) and not _has_latest(path):
        if wanted not in (None, path.name):
            raise CheckpointError(
                f"{os.fspath(path)!r} is one DeepSpeed tag ({path.name!r}); --object "
                f"{wanted!r} names another. Give the directory holding it instead."
            )
        return path
    tags = sorted(n for n in os.listdir(path)
                  if not (path / n).is_symlink() and _owns_model_states(path / n))
    if wanted is None:
        try:
            raw = read_bounded(path / LATEST, 4096, follow_links=False)
        except OSError as exc:
            raise bad(path, f"its {LATEST!r} file cannot be read ({exc})") from None
        wanted = raw.decode("utf-8", errors="replace").strip()
    if (not wanted or len(wanted) > _MAX_TAG or "/" in wanted or "\\" in wanted
            or wanted in (".", "..") or "\0" in wanted):
        raise bad(path, f"the tag {wanted!r:.80} is not a directory name")
    target = path / wanted
    refuse_link(target)
    if not target.is_dir() or not _owns_model_states(target):
        raise CheckpointError(
            f"The DeepSpeed checkpoint {os.fspath(path)!r} has no tag {wanted!r} holding model "
            f"states (its tags: {tags}). Pick one with --object TAG, or give the tag's "
            "directory."
        )
    return target


def _allowed(name: str) -> bool:
    return name in _ALLOWED or name.startswith(_ALLOWED_PREFIXES)


def load_file(file_path: Path) -> Any:
    """One DeepSpeed file, loaded weights-only with its DeepSpeed classes as inert stand-ins.

    Raises:
        CheckpointError: a symbolic link or not a regular file, not a torch zip file, tensors
            larger in logical size than the file allows, a refused global, corrupted.
        OSError: the file cannot be read.
    """
    where = os.fspath(file_path)
    try:
        # no link followed; zip and pickle checked (each tensor's logical size) first
        with opened_torch_file(file_path, follow_links=False) as (file, own):
            if not is_zip(file):
                raise bad(where, "it is not in torch's zip format, which DeepSpeed writes")
            names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
            refused = [n for n in names if not _allowed(n)]
            if refused:
                raise CheckpointError(
                    f"{where!r} is refused: its pickle names {refused}, which no DeepSpeed "
                    "checkpoint holds (only DeepSpeed's own classes and argparse.Namespace are "
                    "read, as inert stand-ins). accel runs no code of a checkpoint; nothing of "
                    "it was loaded."
                )
            stand_ins = inert_globals(names)
            with torch.serialization.safe_globals(stand_ins):
                loaded = torch.load(own, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        reason = " ".join(str(exc).split()).split(" Check the doc")[0][-300:]
        raise CheckpointError(
            f"{where!r} was refused: torch.load(weights_only=True) cannot read it ({reason}). "
            "accel never unpickles checkpoint files."
        ) from None
    except OSError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{where!r} is corrupted or unreadable ({type(exc).__name__}: {exc}). Copy or "
            "write the checkpoint again."
        ) from None
    check_loaded(loaded, lambda what: bad(where, f"it {what}"))
    return loaded


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Size | tuple | list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        return tuple(value)
    return None


def as_int(value: Any) -> int | None:
    """``value`` as an int (an ``IntEnum`` stand-in by its argument), else ``None``."""
    if isinstance(value, InertObject):  # ZeroStageEnum(2): an int enum, recorded by its argument
        args = value.__dict__.get("_args")
        value = args[0] if isinstance(args, tuple) and len(args) == 1 else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tensors(where: Path, key: str, value: Any) -> dict[str, torch.Tensor]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    ):
        raise bad(where, f"its {key!r} is not a dict of tensors by name")
    return dict(value)


def _shapes(where: Path, key: str, value: Any) -> dict[str, tuple[int, ...]]:
    shapes = {k: _shape(v) for k, v in value.items()} if isinstance(value, Mapping) else None
    if shapes is None or not all(isinstance(k, str) for k in shapes):
        raise bad(where, f"its {key!r} is not a dict of shapes by name")
    out = {k: v for k, v in shapes.items() if v is not None}
    if len(out) != len(shapes):
        raise bad(where, f"its {key!r} holds a shape that is not a tuple of sizes")
    return out


@attrs.frozen
class ModelStates:
    """What one ``*model_states.pt`` file holds (checked)."""

    module: dict[str, torch.Tensor]
    buffers: list[str]
    groups: list[dict[str, tuple[int, ...]]]  # trainable parameters, per flat group
    frozen: dict[str, tuple[int, ...]]
    fragments: dict[str, torch.Tensor]
    shared: dict[str, str]
    info: dict[str, Any]  # ds_version, global_steps, dp_world_size, mp_world_size, config_stage
    scheduler: Any  # the ``lr_scheduler`` state dict, or None
    optimizer: Any  # ZeRO-0: the engine optimizer's state dict, or None
    client_keys: tuple[str, ...]  # the script's ``client_state`` keys


def model_states(file_path: Path) -> ModelStates:
    """The checked contents of one ``*model_states.pt`` file.

    Raises:
        CheckpointError: a key missing or not of the kind DeepSpeed writes.
    """
    loaded = load_file(file_path)
    if not isinstance(loaded, Mapping) or "module" not in loaded:
        raise bad(file_path, "it holds no 'module' state")
    module = _tensors(file_path, "module", loaded["module"])
    buffers = loaded.get("buffer_names") or []
    groups = loaded.get("param_shapes")
    if groups is None:
        groups = [{k: tuple(v.shape) for k, v in module.items() if k not in buffers}]
    if not isinstance(buffers, list | tuple) or not all(isinstance(b, str) for b in buffers):
        raise bad(file_path, "its 'buffer_names' is not a list of names")
    if isinstance(groups, Mapping):
        groups = [groups]
    if not isinstance(groups, list | tuple):
        raise bad(file_path, "its 'param_shapes' is not a list of dicts of shapes")
    shared = loaded.get("shared_params") or {}
    if not isinstance(shared, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in shared.items()
    ):
        raise bad(file_path, "its 'shared_params' is not a dict of names")
    config = loaded.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    stage = as_int(zero.get("stage")) if isinstance(zero, Mapping) else None
    version = loaded.get("ds_version")
    info = {
        "ds_version": version if isinstance(version, str) else None,
        "global_steps": as_int(loaded.get("global_steps")),
        "global_samples": as_int(loaded.get("global_samples")),
        "skipped_steps": as_int(loaded.get("skipped_steps")),
        "dp_world_size": as_int(loaded.get("dp_world_size")),
        "mp_world_size": as_int(loaded.get("mp_world_size")),
        "config_stage": stage if stage is not None else 0,
    }
    return ModelStates(
        module=module, buffers=list(buffers),
        groups=[_shapes(file_path, "param_shapes", g) for g in groups],
        frozen=_shapes(file_path, "frozen_param_shapes", loaded.get("frozen_param_shapes") or {}),
        fragments=_tensors(file_path, "frozen_param_fragments",
                           loaded.get("frozen_param_fragments") or {}),
        shared=dict(shared), info=info, scheduler=loaded.get("lr_scheduler"),
        optimizer=loaded.get("optimizer"),
        client_keys=tuple(str(k) for k in loaded if k not in ENGINE_KEYS),
    )


@attrs.frozen
class OptimStates:
    """What one rank's ``*optim_states.pt`` file holds (checked)."""

    stage: int
    partitions: int
    flat: list[torch.Tensor]  # this rank's fp32 master-weight groups (ZeRO-3: sub-groups)
    paddings: list[list[int]] | None  # ZeRO-1/2: alignment padding after each parameter
    group_paddings: list[int] | None  # ZeRO-1/2: padding at the end of each flat partition
    base: Any  # ``base_optimizer_state`` (ZeRO-1/2) / ``optimizer_state_dict`` (ZeRO-3)
    base_step: Any  # ZeRO-1/2 elastic checkpoints: the groups' ``step``, else None


def _sizes(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(
        as_int(p) is not None and p >= 0 for p in value)


def optim_states(file_path: Path) -> OptimStates:
    """The checked contents of one rank's ``*optim_states.pt`` file.

    Raises:
        CheckpointError: no ZeRO 1-3 optimizer state, partitions that are no flat floating
            tensors, groups over several partition counts (expert parallelism).
    """
    loaded = load_file(file_path)
    inner = loaded.get("optimizer_state_dict") if isinstance(loaded, Mapping) else None
    if not isinstance(inner, Mapping):
        raise bad(file_path, "it holds no 'optimizer_state_dict'")
    stage = as_int(inner.get("zero_stage"))
    count: Any = inner.get("partition_count")
    if isinstance(count, list | tuple):
        counts = {as_int(c) for c in count}
        if len(counts) != 1:
            raise bad(file_path, f"its groups are partitioned over {sorted(map(str, counts))} "
                      "ranks (expert parallelism), which accel does not read")
        count = counts.pop()
    partitions = as_int(count)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat = inner.get(key)
    if stage not in (1, 2, 3) or partitions is None or partitions < 1:
        raise bad(file_path, f"it records ZeRO stage {stage!r} over {count!r:.40} ranks")
    if not isinstance(flat, list | tuple) or not all(
        isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype.is_floating_point for t in flat
    ):
        raise bad(file_path, f"its {key!r} is not a list of flat floating tensors")
    paddings: Any = inner.get("param_alignment_paddings")
    if paddings is not None and not (isinstance(paddings, list | tuple)
                                     and all(_sizes(g) for g in paddings)):
        raise bad(file_path, "its 'param_alignment_paddings' is not lists of sizes")
    group_paddings: Any = inner.get("group_paddings")
    if group_paddings is not None and not _sizes(group_paddings):
        raise bad(file_path, "its 'group_paddings' is not a list of sizes")
    base = inner.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    return OptimStates(stage, partitions, list(flat),
                       None if paddings is None else [list(g) for g in paddings],
                       None if group_paddings is None else list(group_paddings), base,
                       inner.get("base_optimizer_state_step"))


def rank_files(tag: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    """The files of ``tag`` matching ``pattern``, by data-parallel rank.

    Raises:
        CheckpointError: a tensor- or pipeline-parallel save, two files for one rank, or a
            file that is a symbolic link.
    """
    found: dict[int, Path] = {}
    for name in sorted(os.listdir(tag)):
        match = pattern.match(name)
        if match is None:
            continue
        if match.group(2) != "00":
            raise CheckpointError(
                f"The DeepSpeed checkpoint {os.fspath(tag)!r} holds {name}: a tensor- or "
                "pipeline-parallel save (model-parallel rank other than 00), which accel does "
                "not read. Use DeepSpeed's own tools, or accel.save_state."
            )
        refuse_link(tag / name)  # a rank's file, read or not, is never a link
        rank = int(match.group(1) or 0)
        if rank in found:
            raise bad(tag, f"it holds two files for rank {rank} ({found[rank].name}, {name})")
        found[rank] = tag / name
    return found
