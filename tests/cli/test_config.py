"""The config file: validation, TOML round trip, path resolution, layers, the questionnaire."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accel.cli.questionnaire import ask_config
from accel.core.config_file import (
    config_path,
    default_config_path,
    dump_config,
    load_config,
    parse_config,
    write_config,
)
from accel.core.env import LaunchEnv
from accel.core.setting_values import validate_setting
from accel.core.settings import SETTINGS
from accel.errors import AbortedError, ConfigError
from accel.launch.config import Resolved, default_settings, resolve_settings


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("mixed_precision", "fp32", "['no', 'fp16', 'bf16', 'fp8']"),
        ("gradient_accumulation_steps", 0, ">= 1"),
        ("gradient_accumulation_steps", 2.5, "whole number"),
        ("num_machines", True, "whole number"),
        ("main_process_port", 70000, "<= 65535"),
        ("cpu", "maybe", "true or false"),
        ("timeout", -1.0, "> 0"),
        ("strategy", "megatron", "['none', 'ddp', 'fsdp', 'deepspeed']"),
    ],
)
def test_invalid_values_name_key_value_and_choices(key: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_setting(key, value, "my.toml")
    message = str(info.value)
    assert f"{key}={value!r}" in message
    assert allowed in message
    assert "my.toml" in message


def test_text_values_are_converted() -> None:
    assert validate_setting("gradient_accumulation_steps", "4") == 4
    assert validate_setting("cpu", "yes") is True
    assert validate_setting("debug", "0") is False
    assert validate_setting("mixed_precision", " BF16 ") == "bf16"
    assert validate_setting("timeout", "60") == 60.0


def test_unknown_key_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting 'mixed_precison'.*mixed_precision"):
        parse_config('mixed_precison = "bf16"', "cfg.toml")


def test_invalid_toml_and_inconsistent_counts() -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("mixed_precision = ", "cfg.toml")
    with pytest.raises(ConfigError, match="not a multiple"):
        parse_config("num_machines = 2\nnum_processes = 3")
    with pytest.raises(ConfigError, match="below num_machines"):
        parse_config("num_machines = 2\nmachine_rank = 2")


_values = {
    "num_machines": st.integers(1, 4),
    "max_restarts": st.integers(0, 9),
    "main_process_ip": st.text(min_size=1).filter(lambda s: s.strip() == s and s),
    "main_process_port": st.integers(1, 65535),
    "mixed_precision": st.sampled_from(SETTINGS["mixed_precision"].choices),
    "gradient_accumulation_steps": st.integers(1, 1000),
    "cpu": st.booleans(),
    "debug": st.booleans(),
    "timeout": st.floats(0.001, 1e9),
}


@given(st.fixed_dictionaries({}, optional=_values))
def test_written_file_reads_back_identically(settings: dict[str, object]) -> None:
    assert parse_config(dump_config(settings)) == settings


def test_write_config_creates_parents_and_load_reads_it(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "config.toml"
    written = write_config(target, {"mixed_precision": "bf16", "num_processes": 4})
    assert written == target
    assert load_config(target) == {"mixed_precision": "bf16", "num_processes": 4}
    assert not list(target.parent.glob(".*tmp"))
    with pytest.raises(ConfigError):
        write_config(target, {"strategy": "zero3"})


def test_path_precedence(tmp_path: Path) -> None:
    env = LaunchEnv(config_file=str(tmp_path / "env.toml"))
    xdg = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert config_path("cli.toml", env=env, environ=xdg) == (Path("cli.toml"), "--config-file")
    assert config_path(None, env=env, environ=xdg) == (tmp_path / "env.toml",
                                                       "$ACCEL_CONFIG_FILE")
    assert config_path(None, env=LaunchEnv(), environ=xdg) == (
        tmp_path / "xdg" / "accel" / "config.toml", "user config dir")
    assert default_config_path({}) == Path.home() / ".config" / "accel" / "config.toml"


def test_load_config_missing_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    assert load_config() == {}  # no user file: no config
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config()
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "config.toml").write_text("debug = true\n")
    monkeypatch.delenv("ACCEL_CONFIG_FILE")
    assert load_config() == {"debug": True}


def test_non_utf8_config_file_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ConfigError, match="UTF-8") as info:
        load_config(bad)
    assert repr(str(bad)) in str(info.value)
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(bad))  # the file found through the variable
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config()
    monkeypatch.delenv("ACCEL_CONFIG_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # and the user config file
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "config.toml").write_bytes("debug = true # é\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config()


def test_each_layer_overrides_the_one_below() -> None:
    file = {"mixed_precision": "fp16", "gradient_accumulation_steps": 2, "debug": True}
    env = LaunchEnv(mixed_precision="bf16", gradient_accumulation_steps=3)
    resolved = resolve_settings({"mixed_precision": "no"}, env, file)
    assert resolved["mixed_precision"] == Resolved("no", "command line")
    assert resolved["gradient_accumulation_steps"] == Resolved(3, "environment")
    assert resolved["debug"] == Resolved(True, "config file")
    assert resolved["cpu"] == Resolved(False, "default")
    assert resolved["strategy"] == Resolved(None, "default")
    with pytest.raises(ConfigError, match="ACCEL_ environment"):
        resolve_settings({}, LaunchEnv(mixed_precision="half"), {})


def test_questionnaire_reasks_bad_answers() -> None:
    answers = iter(["two", "2", "5", "1", "10.0.0.1", "", "3", "4", "maybe", "y", "fp32",
                    "bf16", "0", "8", "auto", "", "yes"])
    prompts: list[str] = []
    said: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers)

    settings = ask_config(read, said.append)
    assert settings == {
        "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
        "main_process_port": 29500, "num_processes": 4, "cpu": True,
        "mixed_precision": "bf16", "gradient_accumulation_steps": 8, "max_restarts": 0,
        "debug": True,
    }
    assert len(prompts) == 17
    assert any("'two'" in line for line in said)
    assert any("below 2" in line for line in said)  # machine_rank 5
    assert any("multiple of the 2 machines" in line for line in said)  # 3 processes
    assert any("'fp32'" in line and "bf16" in line for line in said)


def test_questionnaire_stops_cleanly_at_end_of_input() -> None:
    def read(prompt: str) -> str:
        raise EOFError

    with pytest.raises(AbortedError, match="nothing was written"):
        ask_config(read, lambda text: None)


def test_default_settings_are_valid() -> None:
    defaults = default_settings()
    assert parse_config(dump_config(defaults)) == defaults
    assert defaults["mixed_precision"] == "no"
    assert "num_processes" not in defaults


def test_questionnaire_offers_fp8() -> None:
    answers = iter(["1", "", "n", "fp8", "1", "", "0", "n"])
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers)

    settings = ask_config(read, lambda text: None)
    assert settings["mixed_precision"] == "fp8"
    question = next(p for p in prompts if p.startswith("Mixed precision"))
    assert "no/fp16/bf16/fp8" in question


def test_env_info_under_fp8_notes_only_a_missing_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    from accel.cli import envinfo
    from accel.cli.envinfo import FP8_TORCHAO_NOTE, collect_env_info, format_env_info

    def info() -> dict[str, Any]:
        return collect_env_info(resolve_settings({"mixed_precision": "fp8"}, LaunchEnv(), {}),
                                Path("cfg.toml"), "--config-file")

    fp8 = info()
    assert fp8["notes"] == []  # torchao is installed (accel[test] has accel[fp8])
    assert fp8["settings"]["mixed_precision"] == {"value": "fp8", "source": "command line"}
    assert fp8["settings"]["fp8_recipe"] == {"value": "tensorwise", "source": "default"}
    monkeypatch.setattr(envinfo, "_has_torchao", lambda: False)
    missing = info()
    assert missing["notes"] == [FP8_TORCHAO_NOTE] and "accel[fp8]" in FP8_TORCHAO_NOTE
    assert f"- note: {FP8_TORCHAO_NOTE}" in format_env_info(missing)
    bf16 = collect_env_info(resolve_settings({"mixed_precision": "bf16"}, LaunchEnv(), {}),
                            Path("cfg.toml"), "--config-file")
    assert bf16["notes"] == []
    assert "note:" not in format_env_info(bf16)


def test_a_value_the_file_cannot_hold_is_a_config_type_error() -> None:
    from accel.errors import ConfigTypeError

    with pytest.raises(ConfigTypeError, match=r"\[1, 2\]") as info:
        dump_config({"comm_state_option": {"matrix_approximation_rank": [1, 2]}})
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match="unknown settings"):
        dump_config({"mixed_precison": "bf16"})
