"""``accel checkpoint inspect`` of DeepSpeed's own checkpoint directories (``save_checkpoint``).

The directory is read by :mod:`accel.checkpoint.foreign.deepspeed_params` (which ``accel
merge-weights`` and ``accel.load_state`` use too), running no pickle: see
:mod:`accel.checkpoint.foreign.deepspeed_files`. As there, no link inside is followed: every
entry of the tag that is a symbolic link is a problem (named with its target), and so is a
file whose tensors are larger in logical size than the file allows (stride-0 views).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from accel._files.safe_io import refuse_link
from accel._files.torch_zip import opened_torch_file
from accel.checkpoint.foreign.deepspeed_files import tag_dir
from accel.checkpoint.foreign.deepspeed_params import read_tag
from accel.errors import CheckpointError

__all__ = ["describe_deepspeed"]


def describe_deepspeed(path: Path, tensors: bool) -> dict[str, Any]:
    """The report ``accel checkpoint inspect`` prints for a DeepSpeed checkpoint directory.

    Example:
        >>> describe_deepspeed(Path("ds_ckpt"), tensors=False)["problems"]
        []
    """
    problems: list[str] = []
    try:
        tag = tag_dir(path, None)
    except CheckpointError as exc:
        return {"path": os.fspath(path), "format": "deepspeed", "tag": None, "zero_stage": None,
                "world_size": None, "objects": [], "files": [], "problems": [str(exc)]}
    files = []
    for name in sorted(os.listdir(tag)):
        file = tag / name
        status = "ok (structure; DeepSpeed writes no checksums)"
        try:
            refuse_link(file)  # a link is never followed, whatever its name
            if file.is_dir() or not name.endswith(".pt"):
                status = "not read"
            else:
                with opened_torch_file(file, follow_links=False):
                    pass
        except (OSError, CheckpointError) as exc:
            status = f"invalid: {exc}"
            problems.append(f"{name}: {exc}")
        size = file.stat().st_size if file.is_file() and not file.is_symlink() else None
        files.append({"name": name, "size": size, "status": status})
    report: dict[str, Any] = {
        "path": os.fspath(path), "format": "deepspeed", "tag": tag.name, "zero_stage": None,
        "world_size": None, "ds_version": None, "step": None, "parameters": None,
        "weights": None, "objects": [], "files": files, "problems": problems,
    }
    try:
        read = read_tag(tag, None)
    except (OSError, CheckpointError) as exc:
        problems.append(str(exc))
        return report
    info = read.states.info
    count = sum(math.prod(e.shape) for e in read.entries if e.name not in read.states.buffers)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in read.states.module.values()})
    report.update(
        zero_stage=read.stage, world_size=read.world_size, ds_version=info["ds_version"],
        step=info["global_steps"], parameters=count,
        weights=("fp32 master weights from the optimizer states" if read.master else
                 f"the module's weights ({', '.join(dtypes)})"),
    )
    item: dict[str, Any] = {
        "name": tag.name, "kind": "model",
        "layout": f"ZeRO-{read.stage} over {read.world_size} rank(s)",
        "bytes": sum(f["size"] or 0 for f in files),
    }
    if read.states.shared:
        item["tied"] = dict(read.states.shared)
    if tensors:
        item["tensors"] = [{"name": e.name, "shape": list(e.shape),
                            "dtype": str(e.dtype).removeprefix("torch.")} for e in read.entries]
    report["objects"] = [item]
    return report
