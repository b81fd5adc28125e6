"""Where a model's weights are: the files of a checkpoint (a file, an index, a directory).

:func:`weight_files` lists them (an index's names checked to be plain file names beside it);
:func:`resolve_weights` finds a checkpoint a killed ``save_model`` left in its old place;
:func:`is_complete` tells whether a directory holds a whole weight set. Both ``save_model``
(:mod:`accel.weights.model_io`) and the loaders of :mod:`accel.big_model` use them.

Example:
    >>> weight_files(resolve_weights(Path("out")))
    [PosixPath('out/model.safetensors')]
"""

from __future__ import annotations

import os
from pathlib import Path

from accel._files.atomic import leftovers
from accel._files.safe_io import MAX_JSON_BYTES, load_json, read_bounded
from accel.errors import CheckpointError
from accel.weights import _model_swap

__all__ = [
    "SAFE_INDEX", "SAFE_WEIGHTS", "TORCH_INDEX", "TORCH_WEIGHTS", "is_complete",
    "resolve_weights", "weight_files",
]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


def _plain_file_name(value: object) -> bool:
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in ("/", "\\", "\0"))
        and not os.path.isabs(value)
        and not os.path.splitdrive(value)[0]
    )


def _index_files(index_path: Path) -> list[Path]:
    """The files an index names, each checked to be a plain file name beside the index."""
    where = os.fspath(index_path)
    fix = "Fix the file or write it again with accel.save_model."
    try:  # a link is followed (the Hugging Face cache links files to blobs), a FIFO is not
        raw = read_bounded(index_path, MAX_JSON_BYTES, follow_links=True)
    except OSError as exc:
        raise CheckpointError(f"Index {where!r} cannot be read ({exc}). {fix}") from None
    index = load_json(
        raw, lambda problem: CheckpointError(f"Index {where!r} is not valid: {problem}. {fix}")
    )
    if not isinstance(index, dict):
        problem = f"is a JSON {type(index).__name__}, not an object"
    elif "weight_map" not in index:
        problem = "has no 'weight_map'"
    elif not isinstance(index["weight_map"], dict):
        problem = f"has a 'weight_map' of type {type(index['weight_map']).__name__}"
    else:
        problem = ""
    if problem:
        raise CheckpointError(
            f"Index {where!r} {problem}; an index is "
            '{"metadata": {...}, "weight_map": {"<tensor name>": "<file name>", ...}}. ' + fix
        )
    weight_map: dict[str, object] = index["weight_map"]
    for key, value in weight_map.items():
        if not _plain_file_name(value):
            raise CheckpointError(
                f"Index {where!r} maps {key!r} to {value!r}, which is not a file name in the "
                "index's directory: weight_map values must be plain file names such as "
                "'model-00001-of-00002.safetensors' (no '/', '\\', '..' or absolute path). "
                + fix
            )
    return [index_path.parent / str(f) for f in dict.fromkeys(weight_map.values())]


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds a whole weight set (every file its index names)."""
    try:
        return all(f.is_file() for f in weight_files(directory))
    except (CheckpointError, OSError):
        return False


def resolve_weights(checkpoint: Path) -> Path:
    """``checkpoint``, or where its weights wait while a killed ``save_model`` left it missing.

    That happens only on platforms without an atomic directory swap, killed between the two
    renames: the old directory is put back if this process can take the writer lock, else it
    is read where it is.
    """
    if os.path.lexists(checkpoint) or not checkpoint.name or not leftovers(checkpoint, "old"):
        return checkpoint
    try:
        with _model_swap.locked(checkpoint):
            _model_swap.restore(checkpoint, is_complete)
    except (CheckpointError, OSError):
        pass  # a writer is at work, or this place is read-only
    return _model_swap.old_copy(checkpoint, is_complete) or checkpoint


def weight_files(checkpoint: Path) -> list[Path]:
    """The weight files of a file, an index, or a directory holding one of them."""
    if checkpoint.is_file() and checkpoint.name.endswith(".index.json"):
        return _index_files(checkpoint)
    if checkpoint.is_file():
        return [checkpoint]
    if checkpoint.is_dir():
        for index_name in (SAFE_INDEX, TORCH_INDEX):
            if (checkpoint / index_name).is_file():
                return weight_files(checkpoint / index_name)
        for single in (SAFE_WEIGHTS, TORCH_WEIGHTS):
            if (checkpoint / single).is_file():
                return [checkpoint / single]
        indexes = sorted(p for p in checkpoint.glob("*.index.json") if p.is_file())
        if len(indexes) == 1:  # another library's name for the index, as Accelerate reads
            return _index_files(indexes[0])
        if len(indexes) > 1:
            raise CheckpointError(
                f"{os.fspath(checkpoint)!r} holds several indexes "
                f"{[p.name for p in indexes]!r}; pass the one to load."
            )
    raise CheckpointError(
        f"No weights at {os.fspath(checkpoint)!r}: expected a .safetensors/.bin file, an "
        f"index.json, or a directory holding {SAFE_WEIGHTS}, {SAFE_INDEX}, {TORCH_WEIGHTS} or "
        f"{TORCH_INDEX}."
    )
