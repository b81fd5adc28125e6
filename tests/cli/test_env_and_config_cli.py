"""`accel env` (resolved settings and their layers) and `accel config` (terminal, --default)."""

from __future__ import annotations

import json
import os
import pty
import select
import time
from pathlib import Path
from typing import Any

import pytest

from accel.core.config_file import load_config
from tests.cli._helpers import accel_command, call_accel, clean_env


def _settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str,
              **env: str) -> dict[str, Any]:
    done = call_accel(tmp_path, monkeypatch, "env", "--json", *args, **env)
    assert done.returncode == 0, done.stdout
    info = json.loads(done.stdout)
    return {key: (item["value"], item["source"]) for key, item in info["settings"].items()}


def test_env_shows_each_layer_overriding_the_one_below(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "xdg" / "accel" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('mixed_precision = "fp16"\ngradient_accumulation_steps = 2\n'
                      "num_processes = 4\n")
    base = _settings(tmp_path, monkeypatch)
    assert base["mixed_precision"] == ("fp16", "config file")
    assert base["num_processes"] == (4, "config file")
    assert base["debug"] == (False, "default")
    env_layer = _settings(tmp_path, monkeypatch, ACCEL_MIXED_PRECISION="bf16")
    assert env_layer["mixed_precision"] == ("bf16", "environment")
    assert env_layer["gradient_accumulation_steps"] == (2, "config file")
    cli_layer = _settings(tmp_path, monkeypatch, "--mixed-precision", "no", "--num_processes",
                          "2", ACCEL_MIXED_PRECISION="bf16")
    assert cli_layer["mixed_precision"] == ("no", "command line")
    assert cli_layer["num_processes"] == (2, "command line")
    # $ACCEL_CONFIG_FILE beats the user config dir, --config-file beats both
    other = tmp_path / "other.toml"
    other.write_text("debug = true\n")
    chosen = call_accel(tmp_path, monkeypatch, "env", "--json", ACCEL_CONFIG_FILE=str(other))
    info = json.loads(chosen.stdout)
    assert info["config_file"] == {"path": str(other), "chosen_by": "$ACCEL_CONFIG_FILE",
                                   "exists": True}
    assert info["settings"]["debug"] == {"value": True, "source": "config file"}
    assert info["settings"]["mixed_precision"]["source"] == "default"
    text = call_accel(tmp_path, monkeypatch, "env", "--config-file", str(config))
    assert "config file: " + str(config) + " (--config-file; exists)" in text.stdout
    assert "mixed_precision             = fp16         [config file]" in text.stdout
    assert "- torch: " in text.stdout
    assert "- CPUs: " in text.stdout


def test_invalid_config_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('mixed_precision = "fp32"\n')
    done = call_accel(tmp_path, monkeypatch, "env", "--config-file", str(bad))
    assert done.returncode == 2
    assert "mixed_precision='fp32'" in done.stdout
    assert "['no', 'fp16', 'bf16', 'fp8']" in done.stdout
    assert "Traceback" not in done.stdout


def test_config_default_writes_and_does_not_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "cfg" / "accel.toml"
    done = call_accel(tmp_path, monkeypatch, "config", "--default", "--config-file", str(target))
    assert done.returncode == 0, done.stdout
    assert load_config(target)["mixed_precision"] == "no"
    again = call_accel(tmp_path, monkeypatch, "config", "--default", "--config-file",
                       str(target))
    assert again.returncode == 1
    assert "--force" in again.stdout
    forced = call_accel(tmp_path, monkeypatch, "config", "--default", "--force",
                        "--config-file", str(target))
    assert forced.returncode == 0


def _drive(command: list[str], env: dict[str, str], cwd: Path,
           answers: list[tuple[str, str]], timeout: float = 60) -> tuple[int, str]:
    """Run ``command`` on a pseudo-terminal; answer each prompt containing a text."""
    pid, fd = pty.fork()
    if pid == 0:  # child: becomes the command
        os.chdir(cwd)
        os.execve(command[0], command, env)
    transcript = ""
    pending = list(answers)
    deadline = time.monotonic() + timeout
    status = None
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                transcript += chunk
                # answer when the last line is the expected prompt
                while pending and pending[0][0] in transcript.rsplit("\n", 1)[-1]:
                    os.write(fd, (pending.pop(0)[1] + "\n").encode())
                    transcript += "\n"
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), transcript


@pytest.mark.slow
def test_config_questionnaire_on_a_terminal(tmp_path: Path) -> None:
    target = tmp_path / "asked.toml"
    answers = [
        ("How many machines", "1"),
        ("How many processes in total", "three"),  # re-asked
        ("How many processes in total", "3"),
        ("CPU only", "y"),
        ("Mixed precision", "half"),  # re-asked
        ("Mixed precision", "bf16"),
        ("Gradient accumulation", ""),  # default
        ("Strategy", "ddp"),
        ("restart", "2"),
        ("Debug mode", "n"),
    ]
    code, transcript = _drive(accel_command("config", "--config-file", str(target)),
                              clean_env(tmp_path), tmp_path, answers)
    assert code == 0, transcript
    assert "'three' is not valid for num_processes" in transcript
    assert "'half' is not valid for mixed_precision" in transcript
    assert f"wrote {target}" in transcript
    assert load_config(target) == {
        "num_machines": 1, "num_processes": 3, "cpu": True, "mixed_precision": "bf16",
        "gradient_accumulation_steps": 1, "strategy": "ddp", "max_restarts": 2, "debug": False,
    }


def test_config_stops_without_writing_when_input_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "never.toml"
    done = call_accel(tmp_path, monkeypatch, "config", "--config-file", str(target),
                      stdin="1\n")
    assert done.returncode == 1
    assert "nothing was written" in done.stderr
    assert not target.exists()
