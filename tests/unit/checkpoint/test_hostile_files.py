"""Checkpoints as untrusted input: one process.

A planted lock file is never written through; a checkpoint entry that is a FIFO, a link (to
``/dev/zero`` or to a valid file outside), a deep or duplicate-keyed JSON text or a header with
absurd dimensions is refused with a ``CheckpointError`` before anything is read past what the
manifest declares; a bad old checkpoint never blocks a new save (skipped with a warning, kept).

Inputs that would hang (a FIFO) or eat memory (``/dev/zero``) on a regression are checked in a
child process bounded in time (``subprocess`` timeout) and address space (``RLIMIT_AS``).
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import accel
from accel._files.format import read_safetensors
from accel._files.safe_io import (
    MAX_JSON_DEPTH,
    load_json,
    open_write,
    read_bounded,
    read_declared,
)
from accel.core.strict_json import json_depth
from accel.errors import CheckpointError
from tests.unit.checkpoint._bounded_child import run_cases

DEEP = b"[" * 100_000 + b"]" * 100_000


def _model(value: float = 1.0) -> nn.Linear:
    model = nn.Linear(4, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _save(root: Path, step: int, value: float = 1.0) -> Path:
    return accel.save_state(root, step=step, model=_model(value))


def _manifest(ckpt: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((ckpt / "manifest.json").read_bytes())
    return result


def _declare(ckpt: Path, name: str, data: bytes) -> None:
    """Make the manifest of ``ckpt`` declare ``data`` as the content of entry ``name``."""
    manifest = _manifest(ckpt)
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _replace(ckpt: Path, name: str, data: bytes) -> None:
    """Replace entry ``name`` of ``ckpt`` with ``data``, the manifest agreeing (size, CRC)."""
    (ckpt / name).write_bytes(data)
    _declare(ckpt, name, data)


def _safetensors(header: bytes, data: bytes = b"") -> bytes:
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def _refused(fn: Any, *patterns: str) -> str:
    with pytest.raises(CheckpointError) as raised:
        fn()
    for pattern in patterns:
        assert pattern in str(raised.value), (pattern, str(raised.value))
    return str(raised.value)


# -- bounded child process --------------------------------------------------------------------

_CHILD = r"""
import json, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from pathlib import Path
from torch import nn
import accel

def attempt(op, path):
    try:
        if op == "load_state":
            return "ok: " + repr(accel.load_state(path, model=nn.Linear(4, 4)).path)
        if op == "latest":
            return "ok: " + repr(accel.latest_checkpoint(path))
        if op == "save_rotate":
            return "ok: " + repr(accel.save_state(path, step=9, total_limit=1,
                                                  model=nn.Linear(4, 4)))
        if op == "load_weights":
            return "ok: " + repr(type(accel.load_checkpoint_in_model(nn.Linear(4, 4), path)))
        if op == "load_file":
            return "ok: " + repr(type(accel.load(path)))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "unknown op"

for name, (op, path) in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = attempt(op, path)
    print(json.dumps({name: [result, [str(w.message) for w in caught]]}), flush=True)
"""


def _bounded(cases: dict[str, tuple[str, str]], timeout: float = 120) -> dict[str, Any]:
    """Run each ``name: (op, path)`` in one child limited to 3 GiB of address space and
    ``timeout`` seconds; each result is ``[outcome, warnings]``."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    return run_cases(_CHILD, cases, timeout=timeout, env=env, what="a hostile checkpoint")


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


@pytest.mark.slow
@pytest.mark.ci_extra
def test_fifo_entries_are_refused_without_blocking(tmp_path: Path) -> None:
    cases: dict[str, tuple[str, str]] = {}
    for name in ("model.json", "model.safetensors", "rng_rank0.json", "manifest.json"):
        root = tmp_path / name.replace(".", "_")
        ckpt = _save(root, 1)
        if name != "manifest.json":
            _declare(ckpt, name, b"")  # size 0, CRC 0: what a FIFO's stat shows
        _fifo(ckpt / name)
        cases[f"load {name}"] = ("load_state", os.fspath(ckpt))
    fifo_root = tmp_path / "manifest_json"
    _save(fifo_root, 0, 5.0)  # an older, intact checkpoint under the FIFO-manifest one
    cases["latest"] = ("latest", os.fspath(fifo_root))
    cases["rotate"] = ("save_rotate", os.fspath(fifo_root))
    cases["fallback"] = ("load_state", os.fspath(fifo_root))
    results = _bounded(cases)
    for name in ("model.json", "model.safetensors", "rng_rank0.json", "manifest.json"):
        outcome = results[f"load {name}"][0]
        assert outcome.startswith("CheckpointError") and "FIFO" in outcome, (name, outcome)
    assert results["latest"][0].endswith("checkpoint_0')"), results["latest"]
    assert any("checkpoint_1" in w and "FIFO" in w for w in results["latest"][1])
    assert results["rotate"][0].startswith("ok"), results["rotate"]
    assert any("keeps" in w and "checkpoint_1" in w for w in results["rotate"][1])
    assert results["fallback"][0].endswith("checkpoint_9')"), results["fallback"]
    assert (fifo_root / "checkpoint_1" / "manifest.json").is_fifo()  # kept, never deleted
    assert not (fifo_root / "checkpoint_0").exists()  # rotation still removes intact old ones


@pytest.mark.slow
@pytest.mark.ci_extra
def test_entries_linked_to_dev_zero_are_refused_without_reading(tmp_path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    cases: dict[str, tuple[str, str]] = {}
    for name in ("model.json", "model.safetensors", "manifest.json"):
        root = tmp_path / name.replace(".", "_")
        ckpt = _save(root, 1)
        if name != "manifest.json":
            _declare(ckpt, name, b"")
        (ckpt / name).unlink()
        (ckpt / name).symlink_to("/dev/zero")
        cases[f"load {name}"] = ("load_state", os.fspath(ckpt))
    zero_root = tmp_path / "manifest_json"
    _save(zero_root, 0, 5.0)
    cases["latest"] = ("latest", os.fspath(zero_root))
    cases["rotate"] = ("save_rotate", os.fspath(zero_root))
    weights = tmp_path / "weights"
    accel.save_model(_model(), weights)
    (weights / "model.safetensors.index.json").symlink_to("/dev/zero")
    cases["index"] = ("load_weights", os.fspath(weights / "model.safetensors.index.json"))
    (tmp_path / "zero.pt").symlink_to("/dev/zero")
    cases["accel.load"] = ("load_file", os.fspath(tmp_path / "zero.pt"))
    results = _bounded(cases)
    for name in ("model.json", "model.safetensors", "manifest.json"):
        outcome = results[f"load {name}"][0]
        assert outcome.startswith("CheckpointError") and "symbolic link" in outcome, outcome
    assert results["latest"][0].endswith("checkpoint_0')"), results["latest"]
    assert any("symbolic link" in w for w in results["latest"][1]), results["latest"]
    assert results["rotate"][0].startswith("ok"), results["rotate"]
    assert (zero_root / "checkpoint_1" / "manifest.json").is_symlink()  # kept
    assert results["index"][0].startswith("CheckpointError"), results["index"]
    assert results["accel.load"][0].startswith("CheckpointError"), results["accel.load"]


# -- links ------------------------------------------------------------------------------------


def test_an_entry_linked_to_a_valid_file_outside_is_refused(tmp_path: Path) -> None:
    old = _save(tmp_path / "run", 1, 1.0)
    new = _save(tmp_path / "run", 2, 2.0)
    outside = tmp_path / "elsewhere.safetensors"
    (new / "model.safetensors").rename(outside)  # the very bytes the manifest declares
    (new / "model.safetensors").symlink_to(outside)
    _refused(lambda: accel.load_state(new, model=_model(0.0)), "symbolic link", "elsewhere")
    target = _model(0.0)
    with pytest.warns(UserWarning, match="symbolic link"):
        info = accel.load_state(tmp_path / "run", model=target)
    assert info is not None and info.path == old and float(target.weight.detach()[0, 0]) == 1.0


def test_a_linked_checkpoint_manifest_is_refused(tmp_path: Path) -> None:
    ckpt = _save(tmp_path / "a", 1)
    real = tmp_path / "manifest-copy.json"
    (ckpt / "manifest.json").rename(real)
    (ckpt / "manifest.json").symlink_to(real)
    _refused(lambda: accel.load_state(ckpt, model=_model()), "symbolic link")


# -- lock files -------------------------------------------------------------------------------


def test_save_state_never_writes_through_a_planted_lock_link(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's work\n")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / ".accel-checkpoints.lock").symlink_to(victim)
    _refused(lambda: _save(root, 1), "symbolic link", ".accel-checkpoints.lock")
    assert victim.read_text() == "the user's work\n"
    dangling = tmp_path / "fresh"
    dangling.mkdir()
    (dangling / ".accel-checkpoints.lock").symlink_to(tmp_path / "would-be-created")
    _refused(lambda: _save(dangling, 1), "symbolic link")
    assert not (tmp_path / "would-be-created").exists()


def test_save_model_never_writes_through_a_planted_lock_link(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's work\n")
    (tmp_path / ".out.accel-lock").symlink_to(victim)
    _refused(lambda: accel.save_model(_model(), tmp_path / "out"), "symbolic link")
    assert victim.read_text() == "the user's work\n"
    assert not (tmp_path / "out").exists()


def test_a_lock_name_holding_a_file_accel_did_not_write_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    lock = root / ".accel-checkpoints.lock"
    lock.write_text("notes the user keeps here\n")
    _refused(lambda: _save(root, 1), "did not make it", "notes the user")
    assert lock.read_text() == "notes the user keeps here\n"
    lock.unlink()
    victim = tmp_path / "precious.txt"
    victim.write_text("")  # empty, as a fresh lock: only its second link gives it away
    os.link(victim, lock)
    _refused(lambda: _save(root, 1), "2 hard links")
    lock.unlink()
    os.mkfifo(lock)
    _refused(lambda: _save(root, 1), "FIFO")
    lock.unlink()
    lock.mkdir()
    _refused(lambda: _save(root, 1), "directory")


def test_accels_own_lock_files_are_reused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, 1)
    lock = root / ".accel-checkpoints.lock"
    assert not lock.exists()  # removed by the save that took it
    lock.write_text("pid 1 on another-host\n")  # left by an earlier, killed job
    _save(root, 2)
    assert not lock.exists()  # reused, then removed
    lock.write_text("")  # created, then the process died before it wrote its line
    _save(root, 3)
    assert not lock.exists()
    accel.save_model(_model(), tmp_path / "out")
    (tmp_path / ".out.accel-lock").write_text(f"pid {os.getpid()} on here\n")
    accel.save_model(_model(2.0), tmp_path / "out")
    assert not (tmp_path / ".out.accel-lock").exists()


def test_writing_never_follows_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    _refused(lambda: open_write(tmp_path / "link"), "symbolic link")
    assert victim.read_text() == "keep"


# -- deep, duplicate, non-finite JSON ---------------------------------------------------------


def test_a_deep_manifest_never_blocks_saves_and_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "run"
    bad = _save(root, 1)
    (bad / "manifest.json").write_bytes(DEEP)
    _refused(lambda: accel.load_state(bad, model=_model()), "nest more than 128")
    with pytest.warns(UserWarning, match="latest_checkpoint skips"):
        assert accel.latest_checkpoint(root) is None
    for step in (2, 3, 4):  # every save succeeds; the bad one is neither counted nor deleted
        with pytest.warns(UserWarning, match=r"keeps .*checkpoint_1"):
            accel.save_state(root, step=step, total_limit=1, model=_model(float(step)))
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_1", "checkpoint_4"]
    assert (bad / "manifest.json").read_bytes() == DEEP
    target = _model(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = accel.load_state(root, model=target)
    assert info is not None and info.step == 4 and float(target.weight.detach()[0, 0]) == 4.0


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (DEEP, "nest more than"),
        (b'{"format": "accel-checkpoint", "format": "accel-checkpoint"}', "key 'format' twice"),
        (b'{"format": "accel-checkpoint", "step": NaN}', "NaN"),
        (b'{"format": "accel-checkpoint", "step": 1e400}', "too large"),
        (b"\xff\xfe[\x001\x00]\x00", "UTF-8"),
    ],
)
def test_a_crafted_manifest_is_a_checkpoint_error(tmp_path: Path, text: bytes, why: str) -> None:
    ckpt = _save(tmp_path / "a", 1)
    (ckpt / "manifest.json").write_bytes(text)
    _refused(lambda: accel.load_state(ckpt, model=_model()), why)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (DEEP, "nest more than"),
        (b'{"has_tensors": true, "state": {}, "state": {}, "extra": {}}', "twice"),
        (b'{"has_tensors": false, "state": {"x": Infinity}, "extra": {}}', "Infinity"),
    ],
)
def test_a_crafted_structure_file_is_a_checkpoint_error(
    tmp_path: Path, text: bytes, why: str
) -> None:
    ckpt = _save(tmp_path / "a", 1)
    _replace(ckpt, "model.json", text)  # the manifest agrees: only the content is hostile
    _refused(lambda: accel.load_state(ckpt, model=_model()), "model.json", why)


def test_a_deep_safetensors_header_is_a_checkpoint_error(tmp_path: Path) -> None:
    hostile = _safetensors(b'{"w": ' + DEEP + b"}")  # starts like a header: read as one
    ckpt = _save(tmp_path / "a", 1)
    _replace(ckpt, "model.safetensors", hostile)
    _refused(lambda: accel.load_state(ckpt, model=_model()), "nest more than")
    (tmp_path / "w.safetensors").write_bytes(hostile)
    _refused(lambda: accel.load(tmp_path / "w.safetensors"), "nest more than")
    _refused(lambda: accel.load_checkpoint_in_model(_model(), tmp_path / "w.safetensors"),
             "nest more than")


def test_a_crafted_index_is_a_checkpoint_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    accel.save_model(_model(), out, max_shard_size=40)  # sharded: writes an index
    index = out / "model.safetensors.index.json"
    assert index.is_file()
    good = index.read_bytes()
    index.write_bytes(DEEP)
    _refused(lambda: accel.load_checkpoint_in_model(_model(), out), "nest more than")
    dup = b'{"weight_map": {"weight": "a.safetensors"}, "weight_map": {}}'
    index.write_bytes(dup)
    _refused(lambda: accel.load_checkpoint_in_model(_model(), out), "twice")
    index.write_bytes(good)
    accel.load_checkpoint_in_model(_model(0.0), out)


def test_save_state_refuses_a_state_that_loading_would_refuse(tmp_path: Path) -> None:
    class Deep:
        def state_dict(self) -> dict[str, Any]:
            value: Any = 1
            for _ in range(MAX_JSON_DEPTH + 5):
                value = [value]
            return {"v": value}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            del state

    _refused(lambda: accel.save_state(tmp_path / "a", model=_model(), deep=Deep()),
             "'deep'", "nests more than")
    assert not (tmp_path / "a" / "manifest.json").exists()


# -- absurd tensor headers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [[0, 10**30], [0, 2**62, 4], [0, -1], [0, 1.5], [1] * 65, [0, True]],
)
def test_a_header_with_absurd_dims_is_a_checkpoint_error(tmp_path: Path, shape: Any) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    hostile = _safetensors(header.encode())
    path = tmp_path / "w.safetensors"
    path.write_bytes(hostile)
    _refused(lambda: read_safetensors(path), "w.safetensors", "'w'")
    _refused(lambda: accel.load(path), "'w'")
    _refused(lambda: accel.load_checkpoint_in_model(_model(), path), "'w'")
    ckpt = _save(tmp_path / "a", 1)
    _replace(ckpt, "model.safetensors", hostile)
    _refused(lambda: accel.load_state(ckpt, model=_model()), "'w'")


def test_a_zero_size_tensor_with_sane_dims_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    accel.save({"w": torch.empty(0, 2**20), "v": torch.ones(2)}, path)
    loaded = read_safetensors(path)[0]
    assert loaded["w"].shape == (0, 2**20) and loaded["v"].tolist() == [1.0, 1.0]


# -- the primitives ---------------------------------------------------------------------------


def test_reads_stop_at_the_declared_size(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"12345")
    assert read_declared(path, 5) == b"12345"
    _refused(lambda: read_declared(path, 4), "has 5 bytes, the manifest says 4")
    assert read_bounded(path, 5) == b"12345"
    _refused(lambda: read_bounded(path, 4), "more than 4 bytes")
    with pytest.raises(FileNotFoundError):
        read_declared(tmp_path / "missing", 0)


def test_load_json_refusals() -> None:
    assert load_json(b'{"a": "[[[[", "b": ["\\"]]]", {"c": null}]}') == {
        "a": "[[[[", "b": ['"]]]', {"c": None}]}
    nested = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert json_depth(nested) == MAX_JSON_DEPTH
    load_json(nested)  # the bound itself is allowed
    for text, why in [
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nest more than"),
        (b"[" * 100_000, "nest more than"),  # unclosed: measured before parsing
        (b'{"a": 1, "a": 2}', "twice"),
        (b"[-Infinity]", "-Infinity"),
        (b"[1e999]", "too large"),
        (b"[1", "not valid"),
        (b"9" * 10_000, "not valid"),
    ]:
        _refused(lambda text=text: load_json(text), why)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_TEXT = st.text(alphabet='[]{}"\\ab,:', max_size=6)
_JSON = st.recursive(
    st.none() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_json_depth_matches_the_parsed_nesting(value: Any, indent: bool) -> None:
    text = json.dumps(value, indent=1 if indent else None).encode()
    assert json_depth(text) == _depth(value)
    assert load_json(text) == value
