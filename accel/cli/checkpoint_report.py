"""``accel checkpoint inspect`` and ``accel checkpoint verify``: look inside a checkpoint.

:func:`inspect_checkpoint` describes a ``save_state`` checkpoint: step, world size and the
ranks that wrote it, how sharded objects were split (the mesh at save time, read from the
pieces each rank wrote), every object with its kind and files, every file with its size and
verification status (size and CRC32 against the manifest, then the file's own structure:
JSON, safetensors header), and with ``tensors=True`` every tensor's name, shape and dtype
(global shapes for FSDP-sharded ones). Given the root of numbered checkpoints it lists them
and describes the newest complete one. Directories written by Accelerate's ``save_state`` and
by DeepSpeed's ``save_checkpoint`` (tag, ZeRO stage, world size, parameter count) are described
too (their files carry no checksums: only their structure is checked).

:func:`verify_checkpoint` checks every checkpoint at a path the same way (a root: every
``checkpoint_N``) and collects the problems (a sharded object's pieces must cover each tensor
exactly once; a sharded model's recorded mesh must have positive whole sizes that multiply
to the number of ranks that wrote its pieces, else it is a problem, not reported as fact);
``accel checkpoint verify`` exits non-zero when there is any. Files are opened as untrusted
input (:mod:`accel._files.safe_io`): no link is followed, no special file is read, reads stop
at the declared size.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel._files.format import NAMED_DTYPES, map_safetensors
from accel._files.safe_io import MAX_JSON_BYTES, load_json, open_regular
from accel.checkpoint.layout import MANIFEST, candidates, read_manifest
from accel.cli.checkpoint_source import resolve_checkpoint
from accel.errors import CheckpointError

__all__ = ["format_report", "inspect_checkpoint", "verify_checkpoint"]

_CHUNK = 8 << 20
_SHARDS = "__shards_rank"


def _read_checked(path: Path, size: int, crc: int, check_crc: bool) -> tuple[bytes | None, str]:
    """The file's bytes (JSON files only) and ``"ok"``, or ``None`` and the problem."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None, "missing"
    except (OSError, CheckpointError) as exc:
        return None, f"unreadable: {exc}"
    keep = path.suffix == ".json" and size <= MAX_JSON_BYTES
    parts: list[bytes] = []
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            how = "truncated" if actual < size else "longer than written"
            return None, f"{actual} bytes, the manifest says {size} ({how})"
        if not check_crc and not keep:
            return None, "ok (size only)"
        running, left = 0, size + 1
        while left > 0:
            part = os.read(fd, min(left, _CHUNK))
            if not part:
                break
            running = zlib.crc32(part, running)
            left -= len(part)
            if keep:
                parts.append(part)
        if size + 1 - left != size:
            return None, "changed size while it was read"
    finally:
        os.close(fd)
    if running != crc:
        return None, f"CRC32 {running:#010x}, the manifest says {crc:#010x} (corrupted)"
    return (b"".join(parts) if keep else None), "ok"


def _structure_problem(path: Path, data: bytes | None) -> tuple[Any, str | None]:
    """Parse a JSON file, or check a safetensors header; the parsed JSON and any problem."""
    if path.suffix == ".json" and data is not None:
        try:
            return load_json(data), None
        except CheckpointError as exc:
            return None, str(exc)
    if path.suffix == ".safetensors":
        try:
            map_safetensors(path, follow_links=False).mapped.close()
        except (OSError, CheckpointError) as exc:
            return None, str(exc)
    return None, None


def _kind(name: str, body: Any) -> str:
    state = body.get("state") if isinstance(body, Mapping) else None
    extra = body.get("extra") if isinstance(body, Mapping) else None
    if name == "grad_scaler":
        return "GradScaler"
    if isinstance(extra, Mapping) and "accumulation_step" in extra:
        return "model"
    if isinstance(state, Mapping):
        if {"state", "param_groups"} <= set(state):
            return "optimizer"
        if "last_epoch" in state or "base_lrs" in state or "_last_lr" in state:
            return "scheduler"
        if {"epoch", "batches_yielded"} <= set(state):
            return "data loader"
    return "other"


def _header(path: Path) -> list[dict[str, Any]]:
    found = map_safetensors(path, follow_links=False)
    found.mapped.close()
    return [{"name": k, "shape": list(v["shape"]),
             "dtype": str(NAMED_DTYPES[v["dtype"]]).removeprefix("torch.")}
            for k, v in found.entries]


def _pieces(bodies: Mapping[str, Any], name: str) -> dict[str, list[tuple[Any, Any]]]:
    """``{key: [(offset, shape), ...]}`` over every rank's piece file of object ``name``."""
    found: dict[str, list[tuple[Any, Any]]] = {}
    for file, body in bodies.items():
        if not file.startswith(f"{name}{_SHARDS}"):
            continue
        pieces = body.get("extra", {}).get("pieces") if isinstance(body, Mapping) else None
        for key, spot in (pieces or {}).items():
            if isinstance(spot, Mapping):
                found.setdefault(key, []).append((spot.get("offset"), spot.get("shape")))
    return found


def _coverage(name: str, meta: Mapping[str, Any], pieces: Mapping[str, Any]) -> list[str]:
    """Problems of a sharded object: tensors whose pieces do not cover them exactly once."""
    from accel.checkpoint.sharded.reshard import are_counts, disjoint

    problems = []
    for key, info in meta.items():
        shape = info.get("shape") if isinstance(info, Mapping) else None
        if not are_counts(shape):
            problems.append(f"{name}: no valid global shape for {key!r} ({shape!r:.60})")
            continue
        boxes: list[tuple[list[int], list[int]]] = []
        for offset, size in pieces.get(key, []):
            if not (are_counts(offset) and are_counts(size)
                    and len(offset) == len(size) == len(shape)
                    and all(o + s <= d for o, s, d in zip(offset, size, shape, strict=True))):
                problems.append(f"{name}: a piece of {key!r} lies outside its shape {shape}")
                break
            boxes.append((offset, [o + s for o, s in zip(offset, size, strict=True)]))
        else:
            held = [(lo, hi) for lo, hi in boxes if all(b > a for a, b in zip(lo, hi, strict=True))]
            covered = sum(math.prod(b - a for a, b in zip(lo, hi, strict=True)) for lo, hi in held)
            total = math.prod(shape)
            if covered != total:
                problems.append(
                    f"{name}: the ranks' pieces of {key!r} hold {covered} of its {total} values"
                )
            elif not disjoint(held):
                problems.append(
                    f"{name}: the ranks' pieces of {key!r} overlap: some values are held twice "
                    "and others not at all"
                )
    return problems


def _names(value: Any) -> bool:
    return isinstance(value, list) and 0 < len(value) <= 8 and all(
        isinstance(v, str) and v.isidentifier() for v in value)


def _counts_list(value: Any) -> bool:
    return isinstance(value, list) and 0 < len(value) <= 8 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)


def _mesh_problem(name: str, saved: Any, ranks: list[int]) -> str | None:
    """Why the mesh ``save_state`` recorded for sharded object ``name`` cannot be the one its
    pieces were saved on (``None`` when it can): ``{"dims": [names], "shape": [sizes]}``
    with one positive whole size per named dim, multiplying to the number of ranks that
    wrote pieces, which are ranks 0 to that number - 1."""
    end = " (save_state never records that: the file was altered; loading does not use it)"
    if not isinstance(saved, Mapping):
        return (f"{name}: the recorded mesh {saved!r:.120} is not a mapping {{'dims': [names], "
                f"'shape': [sizes]}}{end}")
    dims: Any = saved.get("dims")
    shape: Any = saved.get("shape")
    if not _names(dims) or len(set(dims)) != len(dims):
        return f"{name}: the recorded mesh dims {dims!r:.120} are not 1 to 8 distinct names{end}"
    if not _counts_list(shape) or len(shape) != len(dims):
        return (f"{name}: the recorded mesh sizes {shape!r:.120} are not positive whole "
                f"numbers, one for each of its dims {dims}{end}")
    total = math.prod(shape)
    if ranks != list(range(total)):
        sizes = ", ".join(f"{d}={s}" for d, s in zip(dims, shape, strict=True))
        return (f"{name}: the recorded mesh ({sizes}) spans {total} rank{'s' * (total != 1)}, "
                f"but ranks {ranks} wrote its pieces{end}")
    return None


def _pipeline_ok(saved: Any) -> bool:
    """Whether a pipelined model's recorded layout is what ``save_state`` writes: a schedule
    name, each stage's units (names), each pipeline rank's stages (numbers of those stages)."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("schedule"), str):
        return False
    stages, ranks = saved.get("stages"), saved.get("ranks")
    if not isinstance(stages, list) or not 0 < len(stages) <= 4096 or not all(
            isinstance(units, list) and all(isinstance(u, str) for u in units)
            for units in stages):
        return False
    return isinstance(ranks, list) and 0 < len(ranks) <= len(stages) and all(
        isinstance(held, list) and held and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(stages)
            for i in held) for held in ranks)


def _units_text(units: list[str]) -> str:
    """A stage's units, the middle of a long run elided."""
    if len(units) <= 5:
        return ", ".join(units) or "(none of its own)"
    return f"{', '.join(units[:2])}, ..., {', '.join(units[-2:])} ({len(units)} units)"


def _split_dims(pieces: Mapping[str, list[tuple[Any, Any]]]) -> list[int]:
    dims = {i for spots in pieces.values() for offset, _ in spots
            if isinstance(offset, list) for i, o in enumerate(offset) if o}
    return sorted(dims)


def _files_by_object(entries: list[dict[str, Any]], objects: list[str]) -> dict[str, list[str]]:
    """Each object's files (``NAME.*`` and ``NAME__*``), in one pass over the entries."""
    names = set(objects)
    owned: dict[str, list[str]] = {}
    for entry in entries:
        stem = entry["name"].split(".", 1)[0]
        candidates = {stem} | {stem[:i] for i in range(len(stem)) if stem.startswith("__", i)}
        for name in candidates & names:
            owned.setdefault(name, []).append(entry["name"])
    return owned


def _describe_accel(path: Path, tensors: bool, check_crc: bool) -> dict[str, Any]:
    manifest = read_manifest(path)
    entries = manifest["files"]
    files, problems, bodies = [], [], {}
    for entry in entries:
        file = path / entry["name"]
        data, status = _read_checked(file, entry["size"], entry["crc32"], check_crc)
        if status.startswith("ok"):
            body, problem = _structure_problem(file, data)
            if problem is not None:
                status = f"invalid: {problem}"
            elif body is not None:
                bodies[entry["name"].removesuffix(".json")] = body
        if not status.startswith("ok"):
            problems.append(f"{entry['name']}: {status}")
        files.append({**entry, "status": status})
    listed = {e["name"] for e in entries} | {MANIFEST}
    others = sorted(set(os.listdir(path)) - listed)
    objects = []
    mesh: dict[str, Any] | None = None
    owned = _files_by_object(entries, manifest["objects"])
    sizes = {e["name"]: e["size"] for e in entries}
    for name in manifest["objects"]:
        body = bodies.get(name)
        if f"{name}.json" not in listed:
            problems.append(f"{name}: its structure file {name}.json is not in the manifest")
        extra = body.get("extra") if isinstance(body, Mapping) else None
        meta = extra.get("sharded") if isinstance(extra, Mapping) else None
        own = sorted(owned.get(name, []))
        item: dict[str, Any] = {
            "name": name, "kind": _kind(name, body), "layout": "full", "files": own,
            "bytes": sum(sizes[f] for f in own),
        }
        if isinstance(extra, Mapping) and isinstance(extra.get("tied"), Mapping):
            item["tied"] = dict(extra["tied"])
        if isinstance(extra, Mapping) and "pipeline" in extra:  # a pipelined model's stages
            if _pipeline_ok(extra["pipeline"]):
                item["pipeline"] = dict(extra["pipeline"])
            else:
                problems.append(f"{name}: the recorded pipeline {extra['pipeline']!r:.120} is "
                                "not {'schedule': name, 'stages': [[units]], 'ranks': "
                                "[[stages]]} (save_state never records that: the file was "
                                "altered; loading does not use it)")
        if isinstance(meta, Mapping):
            pieces = _pieces(bodies, name)
            ranks = sorted({int(rank) for f in own if _SHARDS in f
                            if (rank := f.rsplit("rank", 1)[1].split(".")[0]).isdigit()})
            item["layout"] = f"sharded over ranks {ranks}"
            problems += _coverage(name, meta, pieces)
            # a model's record of the mesh wins; one that cannot be right stays shown
            if mesh is None or not {"sizes", "invalid"} & set(mesh):
                mesh = {"world_size": manifest["world_size"], "dims": 1, "placement": "Shard("
                        + ",".join(map(str, _split_dims(pieces) or [0])) + ")"}
            if isinstance(extra, Mapping) and "mesh" in extra:  # save_state records it
                problem = _mesh_problem(name, extra["mesh"], ranks)
                if problem is not None:
                    problems.append(problem)
                    if "invalid" not in mesh:
                        mesh.pop("sizes", None)
                        mesh.update(dims=None, invalid=problem)
                elif "invalid" not in mesh:
                    saved = extra["mesh"]
                    mesh.update(dims=len(saved["dims"]),
                                sizes=dict(zip(saved["dims"], saved["shape"], strict=True)))
        if tensors:
            item["tensors"] = _tensor_list(path, name, listed, meta, problems)
        objects.append(item)
    return {
        "path": os.fspath(path), "format": "accel", "version": manifest.get("version"),
        "step": manifest["step"], "world_size": manifest["world_size"],
        "ranks": manifest.get("ranks"), "save_id": manifest.get("save_id"),
        "created": manifest.get("created"), "torch": manifest.get("torch"),
        "accel": manifest.get("accel"), "mesh": mesh, "objects": objects, "files": files,
        "other_entries": others, "problems": problems,
    }


def _tensor_list(path: Path, name: str, listed: set[str], meta: Any,
                 problems: list[str]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if f"{name}.safetensors" in listed:
        try:
            found += _header(path / f"{name}.safetensors")
        except (OSError, CheckpointError) as exc:
            problems.append(f"{name}.safetensors: {exc}")
    if isinstance(meta, Mapping):
        found += [{"name": k, "shape": v.get("shape"), "dtype": v.get("dtype"), "sharded": True}
                  for k, v in meta.items() if isinstance(v, Mapping)]
    return found


def _describe_accelerate(path: Path, tensors: bool) -> dict[str, Any]:
    from accel._files.torch_zip import opened_torch_file

    files, problems, objects = [], [], []
    for name in sorted(os.listdir(path)):
        file = path / name
        status = "ok (structure; Accelerate writes no checksums)"
        try:
            if file.is_dir():
                status = "directory (a sharded state accel does not read)"
            elif name.endswith(".safetensors"):
                map_safetensors(file, follow_links=False).mapped.close()
            elif name.endswith((".bin", ".pt")):
                with opened_torch_file(file):
                    pass
            elif name.endswith(".pkl"):
                status = "not opened (a pickle: accel never unpickles)"
        except (OSError, CheckpointError) as exc:
            status = f"invalid: {exc}"
            problems.append(f"{name}: {exc}")
        size = file.stat().st_size if file.is_file() else None
        files.append({"name": name, "size": size, "status": status})
        stem = name.split(".")[0]
        if name.endswith((".safetensors", ".bin", ".pt")) and not name.startswith("random"):
            item: dict[str, Any] = {"name": stem.replace("pytorch_model", "model"), "file": name}
            if tensors and name.endswith(".safetensors") and status.startswith("ok"):
                item["tensors"] = _header(file)
            objects.append(item)
    return {"path": os.fspath(path), "format": "accelerate", "objects": objects,
            "files": files, "problems": problems}


def _describe(path: Path, kind: str, tensors: bool, check_crc: bool) -> dict[str, Any]:
    if kind == "accel":
        return _describe_accel(path, tensors, check_crc)
    if kind == "deepspeed":
        from accel.cli.deepspeed_source import describe_deepspeed

        return describe_deepspeed(path, tensors)
    return _describe_accelerate(path, tensors)


def _root_listing(root: Path) -> list[dict[str, Any]]:
    found, itself = candidates(root)
    if itself:
        return []
    listing: list[dict[str, Any]] = []
    for path in found:
        if _kind_of(path) in ("accelerate", "deepspeed"):
            step = path.name.rsplit("_", 1)[-1]
            listing.append({"path": os.fspath(path), "complete": True,
                            "step": int(step) if step.isdigit() else None})
            continue
        try:
            manifest = read_manifest(path)
            listing.append({"path": os.fspath(path), "step": manifest["step"], "complete": True})
        except CheckpointError as exc:
            listing.append({"path": os.fspath(path), "complete": False, "problem": str(exc)})
    return listing


def inspect_checkpoint(
    path: str | os.PathLike[str], *, tensors: bool = False, check_crc: bool = True
) -> dict[str, Any]:
    """Describe the checkpoint at ``path`` (see the module docstring) as a JSON-ready dict.

    Raises:
        CheckpointError: nothing at ``path`` is a checkpoint, or its manifest is unreadable.

    Example:
        >>> inspect_checkpoint("ckpt")["step"]
        300
    """
    root = Path(path)
    target, kind = resolve_checkpoint(root)
    report = _describe(target, kind, tensors, check_crc)
    listing = _root_listing(root) if target != root else []
    if listing:
        report["checkpoints"] = listing
    return report


def _kind_of(path: Path) -> str:
    from accel.checkpoint.foreign.accelerate import is_accelerate
    from accel.checkpoint.foreign.deepspeed_files import is_deepspeed

    if (path / MANIFEST).exists():
        return "accel"
    return "deepspeed" if is_deepspeed(path) else "accelerate" if is_accelerate(path) else "accel"


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify every checkpoint at ``path`` (a root: each ``checkpoint_N``); collect problems.

    Returns:
        ``{"path", "checkpoints": [{"path", "problems"}], "ok"}``; ``ok`` is ``False`` when any
        file is missing, of another size, fails its CRC32 or its structure check, when a
        sharded object's pieces do not cover it or its recorded mesh cannot be the one its
        pieces were saved on, or when a numbered checkpoint has no readable manifest.

    Raises:
        CheckpointError: nothing at ``path`` is a checkpoint.

    Example:
        >>> verify_checkpoint("ckpt/checkpoint_300")["ok"]
        True
    """
    root = Path(path)
    target, kind = resolve_checkpoint(root)
    results = []
    found = [(target, kind)] if target == root else [
        (Path(item["path"]), _kind_of(Path(item["path"]))) for item in _root_listing(root)]
    for checkpoint, checkpoint_kind in found:
        try:
            problems = _describe(checkpoint, checkpoint_kind, False, True)["problems"]
        except CheckpointError as exc:  # an unreadable manifest
            problems = [str(exc)]
        results.append({"path": os.fspath(checkpoint), "problems": problems})
    return {"path": os.fspath(root), "checkpoints": results,
            "ok": all(not r["problems"] for r in results)}


def _size(size: Any) -> str:
    return "-" if size is None else f"{size:,} B"


def format_report(report: Mapping[str, Any]) -> str:
    """The text ``accel checkpoint inspect`` prints.

    Example:
        >>> print(format_report(inspect_checkpoint("ckpt")))  # doctest: +SKIP
    """
    lines = [f"checkpoint {report['path']} ({report['format']})"]
    if report["format"] == "accel":
        step = "none (saved without step=)" if report["step"] is None else report["step"]
        lines.append(f"step: {step}")
        lines.append(f"saved by {report['world_size']} process(es) (ranks {report['ranks']}) at "
                     f"{report['created']}; torch {report['torch']}, accel {report['accel']}")
        mesh = report["mesh"]
        if not mesh:
            lines.append("mesh: none (no sharded object)")
        elif "invalid" in mesh:
            lines.append(f"mesh: not known: the recorded mesh is invalid (see problems); "
                         f"pieces over {mesh['world_size']} ranks split on dims "
                         f"{mesh['placement'][6:-1]}")
        elif "sizes" in mesh:
            sizes = ", ".join(f"{k}={v}" for k, v in mesh["sizes"].items())
            lines.append(f"mesh: {mesh['dims']}-D ({sizes}) over {mesh['world_size']} ranks, "
                         f"pieces split on dims {mesh['placement'][6:-1]}")
        else:
            lines.append(f"mesh: 1-D over {mesh['world_size']} ranks, FSDP pieces "
                         f"{mesh['placement']}")
        pipeline = next((o["pipeline"] for o in report["objects"] if "pipeline" in o), None)
        if pipeline is not None:
            lines.append(f"pipeline: {pipeline['schedule']}, {len(pipeline['stages'])} stages "
                         f"over {len(pipeline['ranks'])} pp ranks")
            for rank, held in enumerate(pipeline["ranks"]):
                lines += [f"  pp rank {rank}, stage {i}: {_units_text(pipeline['stages'][i])}"
                          for i in held]
    elif report["format"] == "deepspeed":
        lines.append(f"DeepSpeed save_checkpoint, tag {report['tag']!r}: ZeRO stage "
                     f"{report['zero_stage']}, saved by {report['world_size']} process(es), "
                     f"step {report.get('step')}, deepspeed {report.get('ds_version')}")
        if report.get("parameters") is not None:
            lines.append(f"parameters: {report['parameters']:,}; merge-weights writes "
                         f"{report['weights']}")
    lines.append("objects:")
    for obj in report["objects"]:
        text = f"  {obj['name']}"
        if "kind" in obj:
            text += f" ({obj['kind']}): {obj['layout']}, {_size(obj['bytes'])} in its files"
        else:
            text += f" ({obj['file']})"
        if obj.get("tied"):
            text += f", tied {obj['tied']}"
        lines.append(text)
        for tensor in obj.get("tensors", []):
            mark = " (global, sharded)" if tensor.get("sharded") else ""
            lines.append(f"    {tensor['name']}  {tensor['dtype']}  {tensor['shape']}{mark}")
    lines.append("files:")
    for file in report["files"]:
        lines.append(f"  {file['name']}  {_size(file['size'])}  {file['status']}")
    for other in report.get("other_entries", []):
        lines.append(f"  {other}  (not in the manifest: not part of the checkpoint)")
    for item in report.get("checkpoints", []):
        state = f"step {item['step']}" if item["complete"] else "incomplete or unreadable"
        lines.append(f"in the root: {item['path']} ({state})")
    problems = report["problems"]
    lines.append("problems: " + ("none" if not problems else ""))
    lines += [f"  {p}" for p in problems]
    return "\n".join(lines)
