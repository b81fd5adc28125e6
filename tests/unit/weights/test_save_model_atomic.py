"""save_model replaces the weight set as a whole and keeps everything else in the directory."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import accel
from accel._files.atomic import leftovers, writer_lock
from accel.errors import CheckpointError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 8))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _loads(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    fresh = _model(99)
    accel.load_checkpoint_in_model(fresh, path, strict=True)
    return all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())


def _add_user_entries(out: Path) -> dict[str, bytes]:
    """The files a real export directory holds beside the weights."""
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": b'{"hidden": 16}',
        "tokenizer.json": b'{"vocab": ["a", "b"]}',
        "checkpoint_5/manifest.json": b"{}",
        "checkpoint_5/model.safetensors": b"not the exported weights",
    }
    for name, body in files.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_bytes(body)
    (out / "latest").symlink_to("checkpoint_5")
    return files


def _check_user_entries(out: Path, files: dict[str, bytes]) -> None:
    for name, body in files.items():
        assert (out / name).read_bytes() == body, name
    assert (out / "latest").is_symlink() and os.readlink(out / "latest") == "checkpoint_5"


def _no_leftovers(out: Path) -> None:
    assert not [p for kind in ("tmp", "old", "trash") for p in leftovers(out, kind)]


def _scratch(out: Path, kind: str) -> Path:
    return out.with_name(f".{out.name}.{kind}-{uuid.uuid4().hex[:12]}")


@pytest.mark.parametrize("can_exchange", [True, False], ids=["exchange", "rename-aside"])
def test_resave_keeps_user_entries_and_drops_stale_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, can_exchange: bool
) -> None:
    if not can_exchange:
        monkeypatch.setattr("accel.weights._model_swap.exchange", lambda a, b: False)
    out = tmp_path / "export"
    old, new = _model(0), _model(1)
    accel.save_model(old, out, max_shard_size="1KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    files = _add_user_entries(out)
    inode = (out / "config.json").stat().st_ino
    accel.save_model(new, out)  # a single file now: the shards and index are stale
    _check_user_entries(out, files)
    assert (out / "config.json").stat().st_ino == inode  # carried as a hard link, not rewritten
    names = sorted(p.name for p in out.iterdir())
    assert names == ["checkpoint_5", "config.json", "latest", "model.safetensors", "tokenizer.json"]
    assert _loads(out, _weights(new))
    _no_leftovers(out)
    accel.save_model(old, out, max_shard_size="1KB")  # and back to shards
    _check_user_entries(out, files)
    assert not (out / "model.safetensors").exists() and _loads(out, _weights(old))
    _no_leftovers(out)


def test_a_save_that_fails_midway_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "export"
    old = _model(0)
    accel.save_model(old, out, max_shard_size="1KB")
    files = _add_user_entries(out)
    before = sorted(p.name for p in out.iterdir())
    broken = _model(1)
    broken[3].register_buffer("z", torch.zeros(2, dtype=torch.complex64))  # in the last shard
    with pytest.raises(CheckpointError, match="complex64"):
        accel.save_model(broken, out, max_shard_size="1KB")
    assert sorted(p.name for p in out.iterdir()) == before and _loads(out, _weights(old))
    _check_user_entries(out, files)
    _no_leftovers(out)


def test_user_files_are_copied_where_hard_links_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export"
    accel.save_model(_model(0), out)
    files = _add_user_entries(out)

    def no_link(src: object, dst: object, **kwargs: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    accel.save_model(_model(1), out, max_shard_size="1KB")
    _check_user_entries(out, files)
    assert _loads(out, _weights(_model(1)))
    _no_leftovers(out)


def test_a_symlinked_directory_stays_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "disk" / "export"
    accel.save_model(_model(0), real)
    link = tmp_path / "export"
    link.symlink_to(real, target_is_directory=True)
    assert accel.save_model(_model(1), link) == link
    assert link.is_symlink() and _loads(real, _weights(_model(1)))


def test_a_killed_save_is_finished_by_the_next_one(tmp_path: Path) -> None:
    """A save killed after its swap left the old directory, holding a user subdirectory."""
    out = tmp_path / "export"
    accel.save_model(_model(1), out)
    (out / "config.json").write_text("{}")
    aside = _scratch(out, "tmp")
    aside.mkdir()
    safetensors.torch.save_file(_model(0).state_dict(), str(aside / "model.safetensors"))
    os.link(out / "config.json", aside / "config.json")
    (aside / "checkpoint_5").mkdir()
    (aside / "checkpoint_5" / "state.json").write_text("[5]")
    assert _loads(out, _weights(_model(1)))  # loading needs no repair
    accel.save_model(_model(2), out)
    assert (out / "checkpoint_5" / "state.json").read_text() == "[5]"
    assert (out / "config.json").read_text() == "{}" and _loads(out, _weights(_model(2)))
    _no_leftovers(out)


def test_a_missing_directory_is_put_back_from_its_old_copy(tmp_path: Path) -> None:
    """Killed between the two renames of the rename-aside fallback: only ``.NAME.old-*`` is left."""
    out = tmp_path / "export"
    accel.save_model(_model(0), out, max_shard_size="1KB")
    files = _add_user_entries(out)
    aside = _scratch(out, "old")
    out.rename(aside)
    assert _loads(out, _weights(_model(0)))  # the loader finds (and restores) the old set
    _check_user_entries(out, files)
    aside = _scratch(out, "old")
    out.rename(aside)
    accel.save_model(_model(1), out)
    _check_user_entries(out, files)
    assert _loads(out, _weights(_model(1)))
    _no_leftovers(out)


def test_a_missing_directory_is_read_in_place_while_a_writer_holds_the_lock(
    tmp_path: Path,
) -> None:
    out = tmp_path / "export"
    accel.save_model(_model(0), out)
    aside = _scratch(out, "old")
    out.rename(aside)
    with writer_lock(tmp_path / ".export.accel-lock", "test"):
        assert _loads(out, _weights(_model(0)))
    assert not out.exists() and aside.is_dir()  # the lock holder decides, not the reader


def test_unknown_entries_in_a_leftover_are_kept_with_a_warning(tmp_path: Path) -> None:
    out = tmp_path / "export"
    accel.save_model(_model(0), out)
    (out / "config.json").write_text("new")
    aside = _scratch(out, "tmp")
    aside.mkdir()
    (aside / "config.json").write_text("old")  # not ours, and out has a different one
    with pytest.warns(UserWarning, match=str(aside.name)):
        accel.save_model(_model(1), out)
    assert (aside / "config.json").read_text() == "old"
    assert (out / "config.json").read_text() == "new"


def test_save_model_refuses_what_it_cannot_replace(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        accel.save_model(_model(0), tmp_path / "file")
    (tmp_path / "out" / "model.safetensors").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        accel.save_model(_model(0), tmp_path / "out")
    busy = writer_lock(tmp_path / ".busy.accel-lock", "test")
    with busy, pytest.raises(CheckpointError, match="Another writer"):
        accel.save_model(_model(0), tmp_path / "busy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]  # released: removed
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"]


def _index(directory: Path, weight_map: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize(
    "value",
    ["../outside.safetensors", "../../outside.safetensors", "sub/../../outside.safetensors",
     "/tmp/outside.safetensors", "..", ".", "", "sub\\x.safetensors", 3, None],
)
def test_index_entries_cannot_escape_the_directory(tmp_path: Path, value: object) -> None:
    model = _model(0)
    safetensors.torch.save_file(model.state_dict(), str(tmp_path / "outside.safetensors"))
    ckpt = tmp_path / "a" / "b"
    index = _index(ckpt, {"0.weight": value})
    for source in (ckpt, index):
        with pytest.raises(CheckpointError, match=r"0\.weight.*" + re.escape(repr(value))):
            accel.load_checkpoint_in_model(_model(1), source)


@pytest.mark.parametrize("body", ['{"weight_map": ["a"]}', '{"metadata": {}}', "[1]", "{nope"])
def test_malformed_index_is_a_checkpoint_error(tmp_path: Path, body: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(body)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        accel.load_checkpoint_in_model(_model(0), tmp_path)
