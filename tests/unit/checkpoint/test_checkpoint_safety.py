"""save_state / load_state never lose the user's work: one process.

Directories accel did not write are refused, replacing a checkpoint leaves no instant without
one, steps are validated, a corrupt newest checkpoint falls back to an older intact one, every
failure is a CheckpointError, and a failed load changes nothing.
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
from torch import nn

import accel
from accel._files import atomic as _atomic
from accel._files.encode import decode
from accel.errors import CheckpointError


def _model(value: float = 1.0, width: int = 4) -> nn.Linear:
    model = nn.Linear(width, width)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _trained(value: float) -> tuple[nn.Linear, torch.optim.Optimizer]:
    model = _model(value)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(*objs: Any) -> list[Any]:
    out = []
    for obj in objs:
        sd = obj.state_dict()
        out.append(json.dumps(sd, default=lambda t: t.tolist(), sort_keys=True))
    return out


# -- directories accel did not write -------------------------------------------------------


def test_save_without_step_refuses_a_directory_holding_other_files(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    (out / "checkpoint_5").mkdir(parents=True)
    (out / "checkpoint_5" / "weights.bin").write_bytes(b"user data")
    (out / "train_log.txt").write_text("epoch 1: loss 0.3\n")
    model, opt = _trained(1.0)
    with pytest.raises(CheckpointError, match=r"train_log\.txt") as raised:
        accel.save_state(out, model=model, optimizer=opt)
    assert "checkpoint_5" in str(raised.value) and "step=" in str(raised.value)
    assert (out / "train_log.txt").read_text() == "epoch 1: loss 0.3\n"
    assert (out / "checkpoint_5" / "weights.bin").read_bytes() == b"user data"
    assert sorted(p.name for p in tmp_path.iterdir() if "lock" not in p.name) == ["outputs"]
    # numbered checkpoints inside the same directory are fine and leave the user's files
    accel.save_state(out, step=6, total_limit=1, model=model, optimizer=opt)
    assert (out / "train_log.txt").exists() and (out / "checkpoint_5" / "weights.bin").exists()


def test_resaving_a_fixed_directory_replaces_only_accels_own_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()  # an empty directory is fine
    accel.save_state(out, model=_model(1.0))
    accel.save_state(out, model=_model(2.0))
    restored = _model(0.0)
    info = accel.load_state(out, model=restored)
    assert info is not None and info.path == out
    assert torch.all(restored.weight == 2.0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".ckpt.accel-lock") == ["ckpt"]
    (out / "notes.txt").write_text("mine")  # the user adds a file inside the checkpoint
    with pytest.raises(CheckpointError, match=r"notes\.txt"):
        accel.save_state(out, model=_model(3.0))
    assert (out / "notes.txt").read_text() == "mine"
    accel.load_state(out, model=restored)
    assert torch.all(restored.weight == 2.0)


def test_a_file_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.write_text("not a directory")
    with pytest.raises(CheckpointError, match="ckpt"):
        accel.save_state(target, model=_model())
    assert target.read_text() == "not a directory"


# -- steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [-1, 3.0, True, "7", 1e21, [2]])
def test_step_must_be_a_non_negative_int(tmp_path: Path, step: Any) -> None:
    with pytest.raises(CheckpointError, match=r"step=") as raised:
        accel.save_state(tmp_path, step=step, model=_model())
    assert isinstance(raised.value, ValueError | TypeError | accel.errors.CheckpointArgumentError)
    assert repr(step) in str(raised.value)
    assert not any(tmp_path.iterdir())


def test_step_zero_and_numpy_like_ints_are_found_again(tmp_path: Path) -> None:
    accel.save_state(tmp_path, step=0, model=_model(1.0))
    numpy = pytest.importorskip("numpy")
    accel.save_state(tmp_path, step=numpy.int64(3), model=_model(3.0))
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_3"


# -- replacing with no window --------------------------------------------------------------


def test_no_instant_without_a_checkpoint_while_replacing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ckpt"
    accel.save_state(out, model=_model(1.0))
    seen: list[bool] = []
    real_replace = os.replace

    def watching_replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        seen.append(accel.latest_checkpoint(out) is not None)

    monkeypatch.setattr(os, "replace", watching_replace)
    accel.save_state(out, model=_model(2.0))
    monkeypatch.undo()
    assert seen and all(seen)


def test_killed_between_the_fallback_renames_loads_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the platform cannot swap atomically, a crash between the two renames of a
    replacement leaves the old checkpoint aside: it is still found, and the next save puts
    things right."""
    out = tmp_path / "ckpt"
    accel.save_state(out, model=_model(1.0))
    monkeypatch.setattr(_atomic, "exchange", lambda a, b: False)
    real_replace = os.replace
    calls = {"n": 0}

    def crash_on_second(src: Any, dst: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2 and Path(dst) == out:
            raise KeyboardInterrupt("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        accel.save_state(out, model=_model(2.0))
    monkeypatch.setattr(os, "replace", real_replace)
    assert not out.exists()  # the window the fallback has
    restored = _model(0.0)
    info = accel.load_state(out, missing_ok=True, model=restored)
    assert info is not None, "resume silently restarted from scratch"
    assert torch.all(restored.weight == 1.0)
    accel.save_state(out, model=_model(3.0))  # recovers, then replaces, then cleans up
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".ckpt.accel-lock") == ["ckpt"]
    accel.load_state(out, model=restored)
    assert torch.all(restored.weight == 3.0)


# -- falling back from a corrupt newest checkpoint ------------------------------------------


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    ["flip_weights", "truncate_weights", "drop_manifest_field", "delete_rng", "garbage_manifest"],
)
def test_load_falls_back_to_the_newest_checkpoint_that_verifies(
    tmp_path: Path, damage: str
) -> None:
    for step in (1, 2, 3):
        accel.save_state(tmp_path, step=step, model=_model(float(step)))
    newest = tmp_path / "checkpoint_3"
    if damage == "flip_weights":
        _flip_byte(newest / "model.safetensors")
    elif damage == "truncate_weights":
        data = (newest / "model.safetensors").read_bytes()
        (newest / "model.safetensors").write_bytes(data[:-7])
    elif damage == "drop_manifest_field":
        manifest = json.loads((newest / "manifest.json").read_text())
        del manifest["files"]
        (newest / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "delete_rng":
        (newest / "rng_rank0.json").unlink()
    else:
        (newest / "manifest.json").write_bytes(b"\x00\xff{")
    restored = _model(0.0)
    with pytest.warns(UserWarning, match=r"checkpoint_3") as caught:
        info = accel.load_state(tmp_path, model=restored)
    assert info is not None and info.step == 2
    assert torch.all(restored.weight == 2.0)
    assert any("checkpoint_2" in str(w.message) for w in caught)
    # an explicit checkpoint directory never falls back
    with pytest.raises(CheckpointError, match="checkpoint_3"):
        accel.load_state(newest, model=restored)
    assert torch.all(restored.weight == 2.0)


def test_every_checkpoint_corrupt_raises_even_with_missing_ok(tmp_path: Path) -> None:
    for step in (1, 2):
        accel.save_state(tmp_path, step=step, model=_model(float(step)))
        _flip_byte(tmp_path / f"checkpoint_{step}" / "model.safetensors")
    restored = _model(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"checkpoint_2.*checkpoint_1"):
            accel.load_state(tmp_path, missing_ok=True, model=restored)
    assert torch.all(restored.weight == 0.0)


def test_a_fixed_checkpoint_missing_its_manifest_is_not_silently_skipped(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ckpt"
    accel.save_state(out, model=_model(1.0))
    (out / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest"):
        accel.load_state(out, missing_ok=True, model=_model(0.0))


# -- every failure is a CheckpointError; a failed load changes nothing ----------------------


def test_state_dict_that_raises_becomes_a_checkpoint_error(tmp_path: Path) -> None:
    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("cannot serialise this")

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    accel.save_state(tmp_path, step=1, model=_model(1.0))
    with pytest.raises(CheckpointError, match="cannot serialise this"):
        accel.save_state(tmp_path, step=2, model=_model(2.0), broken=Broken())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith("lock")) == [
        "checkpoint_1"
    ]


def test_wrong_shapes_fail_before_anything_is_restored(tmp_path: Path) -> None:
    model, opt = _trained(1.0)
    accel.save_state(tmp_path, model=model, optimizer=opt)
    other = _model(5.0, width=3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    before = _snapshot(other, other_opt)
    with pytest.raises(CheckpointError, match=r"weight.*\(4, 4\).*\(3, 3\)"):
        accel.load_state(tmp_path, model=other, optimizer=other_opt)
    assert _snapshot(other, other_opt) == before
    # model fine, optimizer of another structure: the model is not restored either
    fresh = _model(7.0)
    wrong_opt = torch.optim.AdamW([fresh.weight], lr=0.1)  # one parameter instead of two
    before = _snapshot(fresh, wrong_opt)
    with pytest.raises(CheckpointError, match="optimizer"):
        accel.load_state(tmp_path, model=fresh, optimizer=wrong_opt)
    assert _snapshot(fresh, wrong_opt) == before


def test_load_state_dict_that_raises_becomes_a_checkpoint_error(tmp_path: Path) -> None:
    class Picky:
        def state_dict(self) -> dict[str, Any]:
            return {"n": 1}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            raise KeyError("missing 'm'")

    accel.save_state(tmp_path, picky=Picky())
    with pytest.raises(CheckpointError, match="picky"):
        accel.load_state(tmp_path, picky=Picky())


def _rewrite(file: Path, data: bytes, manifest_dir: Path) -> None:
    """Replace a file and update the manifest so that only its content is wrong."""
    file.write_bytes(data)
    manifest = json.loads((manifest_dir / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == file.name:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (manifest_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("shape", "why"), [([4, 5], "shape"), ([-4, -4], "shape"), ("4x4", "shape")]
)
def test_crafted_safetensors_headers_are_refused(tmp_path: Path, shape: Any, why: str) -> None:
    path = accel.save_state(tmp_path, model=_model(1.0))
    file = path / "model.safetensors"
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["weight"]["shape"] = shape
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    _rewrite(file, struct.pack("<Q", len(encoded)) + encoded + data[8 + length :], path)
    restored = _model(0.0)
    with pytest.raises(CheckpointError, match=why):
        accel.load_state(path, model=restored)
    assert torch.all(restored.weight == 0.0)


@pytest.mark.parametrize(
    "change",
    [
        {"files": "all"},
        {"files": [{"name": 3, "size": "x", "crc32": None, "rank": 0}]},
        {"objects": [1, 2]},
        {"world_size": "2"},
        {"step": "7"},
        {"files": [{"name": "../../etc/passwd", "size": 1, "crc32": 0, "rank": 0}]},
    ],
)
def test_manifests_with_wrong_types_are_refused(tmp_path: Path, change: dict[str, Any]) -> None:
    path = accel.save_state(tmp_path, model=_model(1.0))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(change)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest"):
        accel.load_state(path, model=_model(0.0))


def test_dtype_tags_accept_only_dtype_names() -> None:
    assert decode({"__dtype__": "float16"}, {}) is torch.float16
    for name in ("load", "save", "__import__", "nn"):
        with pytest.raises(CheckpointError, match=repr(name)):
            decode({"__dtype__": name}, {})


# -- two writers ---------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_its_temporaries_survive(tmp_path: Path) -> None:
    live_tmp = tmp_path / ".checkpoint_9.tmp-0123456789ab"  # another writer at work
    live_tmp.mkdir()
    (live_tmp / "model.safetensors").write_bytes(b"in progress")
    lock = tmp_path / ".accel-checkpoints.lock"
    with _atomic.writer_lock(lock, "the test"):
        with pytest.raises(CheckpointError, match="Another writer"):
            accel.save_state(tmp_path, step=1, total_limit=1, model=_model())
        assert live_tmp.exists()
    # once no writer holds the lock, a save removes what killed writers left
    accel.save_state(tmp_path, step=1, total_limit=1, model=_model())
    assert not live_tmp.exists()
