"""Trackers never write outside ``project_dir``, and ``log_with="all"`` keeps wandb offline."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import accel
from accel.errors import AccelError, ConfigError
from accel.testing import fake_state


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


@pytest.mark.parametrize(
    "run_name",
    ["../../x", "a/../../b", "..", ".", "", "a/b", "a\\b", "x\0y", "<absolute>"],
)
@pytest.mark.parametrize("log_with", [("jsonl",), ("jsonl", "tensorboard")])
def test_run_names_that_leave_project_dir_are_refused(
    tmp_path: Path, run_name: str, log_with: tuple[str, ...]
) -> None:
    if run_name == "<absolute>":
        run_name = str(tmp_path / "outside" / "x")
    project_dir = tmp_path / "a" / "b" / "proj"
    with (
        pytest.raises(ConfigError, match="run_name") as info,
        accel.tracking(project_dir, log_with=log_with, run_name=run_name),
    ):
        accel.log({"loss": 1.0}, step=1)
    message = str(info.value)
    assert repr(run_name) in message and "`run_name=" in message  # the value and the fix
    assert isinstance(info.value, AccelError) and isinstance(info.value, ValueError)
    assert _files(tmp_path) == []  # nothing written, not even project_dir


def test_run_names_are_checked_on_every_rank(tmp_path: Path) -> None:
    with (
        fake_state(rank=1, world_size=2),
        pytest.raises(ConfigError, match="run_name"),
        accel.tracking(tmp_path, run_name="../x"),
    ):
        pass


@pytest.mark.parametrize("run_name", ["exp-1", "exp 2.v3", "...", "é-run", ".hidden"])
def test_plain_run_names_write_inside_project_dir(tmp_path: Path, run_name: str) -> None:
    project_dir = tmp_path / "proj"
    with accel.tracking(project_dir, run_name=run_name) as run:
        accel.log({"loss": 1.0}, step=1)
    assert run.directory == project_dir / run_name
    assert (project_dir / run_name / "metrics.jsonl").is_file()
    assert all(project_dir in path.parents for path in _files(tmp_path) if path != project_dir)


class _FakeRun:
    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, Any], int | None]] = []
        self.exit_code: int | None = None

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        self.rows.append((values, step))

    def finish(self, exit_code: int = 0) -> None:
        self.exit_code = exit_code


@pytest.fixture
def wandb_inits(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A fake ``wandb`` module (importable, findable) that records its ``init`` kwargs."""
    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> _FakeRun:
        calls.append(kwargs)
        return _FakeRun()

    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # "all" picks jsonl and the fake wandb only, not other trackers that may be installed
    monkeypatch.setattr(accel.trackers, "_installed", lambda package: package in (None, "wandb"))
    return calls


def _track(project_dir: Path, **kwargs: Any) -> None:
    with accel.tracking(project_dir, run_name="r", **kwargs) as run:
        assert "wandb" in run.tracker_names
        accel.log({"loss": 0.5}, step=1)


def test_log_with_all_starts_wandb_offline(
    tmp_path: Path, wandb_inits: list[dict[str, Any]]
) -> None:
    _track(tmp_path, log_with="all")
    (kwargs,) = wandb_inits
    assert kwargs["mode"] == "offline"
    assert kwargs["dir"] == str(tmp_path / "r")


def test_log_with_all_honours_an_explicit_wandb_mode_variable(
    tmp_path: Path, wandb_inits: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")
    _track(tmp_path, log_with="all")
    (kwargs,) = wandb_inits
    assert "mode" not in kwargs  # wandb applies WANDB_MODE=online itself


def test_log_with_all_honours_an_explicit_init_mode(
    tmp_path: Path, wandb_inits: list[dict[str, Any]]
) -> None:
    _track(tmp_path, log_with="all", init_kwargs={"wandb": {"mode": "online"}})
    (kwargs,) = wandb_inits
    assert kwargs["mode"] == "online"


@pytest.mark.parametrize("log_with", ["wandb", ("all", "wandb"), ("jsonl", "wandb")])
def test_naming_wandb_keeps_its_own_default(
    tmp_path: Path, wandb_inits: list[dict[str, Any]], log_with: Any
) -> None:
    _track(tmp_path, log_with=log_with)
    (kwargs,) = wandb_inits
    assert "mode" not in kwargs  # asked for by name: wandb's own settings decide
