"""DDP options on one process: accepted and ignored (said once), checked, merged, from a file."""

from __future__ import annotations

import enum
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.core.config_file import dump_config, parse_config
from accel.core.scope import Scope
from accel.core.setting_values import validate_setting
from accel.core.state import ProcessState, set_state
from accel.errors import ConfigError
from accel.parallel import ddp as _ddp

ALL_OPTIONS: dict[str, Any] = {
    "find_unused_parameters": True,
    "static_graph": True,
    "gradient_as_bucket_view": True,
    "bucket_cap_mb": 50,
    "broadcast_buffers": False,
    "comm_hook": "power_sgd",
    "comm_wrapper": "fp16",
    "comm_state_option": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 10},
}


@pytest.fixture
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user config file; returns a path a test may write one to (ACCEL_CONFIG_FILE)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    return tmp_path / "accel.toml"


@contextmanager
def fake(**fields: Any) -> Iterator[ProcessState]:
    with set_state(ProcessState(**fields), Scope()) as st:
        yield st


def _ignored_notes(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "accel.parallel.ddp" and "ignored" in r.message]


def test_one_process_accepts_every_option_and_says_once_at_debug(
    caplog: pytest.LogCaptureFixture, no_config: Path
) -> None:
    caplog.set_level(logging.DEBUG, logger="accel.parallel.ddp")

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        raise AssertionError("never registered on one process")

    with accel.distributed(find_unused_parameters=True, comm_hook="fp16"):
        net = nn.Linear(4, 2)
        assert accel.prepare_model(net, **ALL_OPTIONS) is net
        other = nn.Linear(4, 2)
        assert accel.prepare_model(other, comm_hook=hook, comm_state=object()) is other
        assert accel.prepare_model(nn.Linear(2, 2)) is not None  # options from distributed()
    notes = _ignored_notes(caplog)
    assert len(notes) == 1
    assert notes[0].levelno == logging.DEBUG
    assert "(one process)" in notes[0].message
    assert "find_unused_parameters" in notes[0].message


@pytest.mark.parametrize(
    ("fields", "kwargs", "reason"),
    [
        ({"world_size": 2, "strategy": "none"}, {}, "strategy='none'"),
        ({"world_size": 2, "strategy": "ddp"}, {"evaluation_mode": True}, "evaluation_mode"),
        ({"world_size": 2, "strategy": "ddp"}, {"frozen": True}, "no trainable parameter"),
    ],
)
def test_no_ddp_wrapper_means_options_ignored(
    fields: dict[str, Any], kwargs: dict[str, Any], reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # world_size 2 without a process group: reaching DDP would raise
    caplog.set_level(logging.DEBUG, logger="accel.parallel.ddp")
    frozen = kwargs.pop("frozen", False)
    net = nn.Linear(4, 2).requires_grad_(not frozen)
    with fake(**fields):
        assert accel.prepare_model(net, **kwargs, **ALL_OPTIONS) is net
    (note,) = _ignored_notes(caplog)
    assert reason in note.message


def test_nothing_said_without_ddp_options(
    caplog: pytest.LogCaptureFixture, no_config: Path
) -> None:
    caplog.set_level(logging.DEBUG, logger="accel.parallel.ddp")
    with accel.distributed(reshard_after_forward=False):  # FSDP options are not DDP options
        accel.prepare_model(nn.Linear(2, 2))
    assert _ignored_notes(caplog) == []


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("find_unused_parameters", "yes", "True or False"),
        ("static_graph", 1, "True or False"),
        ("gradient_as_bucket_view", None, "True or False"),
        ("broadcast_buffers", "false", "True or False"),
        ("bucket_cap_mb", 0, "a number of megabytes > 0"),
        ("bucket_cap_mb", -5.0, "a number of megabytes > 0"),
        ("bucket_cap_mb", True, "a number of megabytes > 0"),
        ("bucket_cap_mb", float("inf"), "a number of megabytes > 0"),
        ("bucket_cap_mb", "25", "a number of megabytes > 0"),
        ("comm_hook", "fp8", "['no', 'fp16', 'bf16', 'power_sgd', 'batched_power_sgd']"),
        ("comm_hook", 3, "or a callable"),
        ("comm_wrapper", "power_sgd", "['no', 'fp16', 'bf16']"),
        ("comm_wrapper", print, "['no', 'fp16', 'bf16']"),
        ("comm_state_option", [("matrix_approximation_rank", 2)], "a dict of PowerSGD options"),
    ],
)
def test_bad_values_name_key_value_and_expected_form(
    key: str, value: object, expected: str, no_config: Path
) -> None:
    # the same error on one process as on N, from prepare_model and from distributed()
    with fake(), pytest.raises(ConfigError) as info:
        accel.prepare_model(nn.Linear(2, 2), **{key: value})
    message = str(info.value)
    assert f"{key}={value!r}" in message and expected in message
    assert "accel.prepare_model" in message
    with accel.distributed(**{key: value}), pytest.raises(ConfigError) as info:
        accel.prepare_model(nn.Linear(2, 2))
    assert f"{key}={value!r}" in str(info.value) and expected in str(info.value)
    assert "accel.distributed() or the config file" in str(info.value)


def test_unknown_option_names_key_and_lists_known_ones() -> None:
    with fake(), pytest.raises(ConfigError) as info:
        accel.prepare_model(nn.Linear(2, 2), find_unused_parameter=True)
    message = str(info.value)
    assert "'find_unused_parameter'" in message
    assert "did you mean 'find_unused_parameters'?" in message
    for known in _ddp.KNOWN_OPTIONS:
        assert known in message
    with fake(world_size=2, strategy="none"), pytest.raises(ConfigError, match="'device_ids'"):
        accel.prepare_model(nn.Linear(2, 2), device_ids=[0])


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"matrix_approximation_rank": 0}, r"\['matrix_approximation_rank'\]=0 .* >= 1"),
        ({"matrix_approx_rank": 2}, "unknown PowerSGD option 'matrix_approx_rank'"),
        ({"warm_start": "yes"}, r"\['warm_start'\]='yes' .* True or False"),
        ({"min_compression_rate": float("nan")}, "a number >= 0"),
        ({"random_seed": 1.5}, "a whole number >= 0"),
        ({"start_powerSGD_iter": 1}, r"must be > 1 while use_error_feedback or warm_start"),
        ({1: 2}, "unknown PowerSGD option 1"),
    ],
)
def test_bad_power_sgd_options(option: dict[Any, Any], match: str) -> None:
    with fake(), pytest.raises(ConfigError, match=match):
        accel.prepare_model(nn.Linear(2, 2), comm_hook="power_sgd", comm_state_option=option)


def test_power_sgd_rule_off_when_feedback_and_warm_start_are_off() -> None:
    option = {"start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False}
    assert _ddp.check_option("comm_state_option", option) == option


def test_comm_state_needs_a_callable_hook() -> None:
    with fake(), pytest.raises(ConfigError, match=r"comm_state=.*comm_hook='fp16'.*my_hook"):
        accel.prepare_model(nn.Linear(2, 2), comm_hook="fp16", comm_state={"n": 0})


def _two_names(state, grads):  # type: ignore[no-untyped-def]
    return grads


def _string_annotations(state: object, bucket: object) -> object:  # strings: future import
    return bucket


def test_callable_hook_signature_is_checked() -> None:
    with fake(), pytest.raises(ConfigError, match=r"parameters are \['state', 'grads'\]"):
        accel.prepare_model(nn.Linear(2, 2), comm_hook=_two_names)
    with fake(), pytest.raises(ConfigError, match="annotations are strings"):
        accel.prepare_model(nn.Linear(2, 2), comm_hook=_string_annotations)


def test_values_are_normalised() -> None:
    class HookType(str, enum.Enum):  # noqa: UP042 - Accelerate's DDPCommunicationHookType is one
        FP16 = "fp16"
        POWER_SGD = "power_sgd"

    assert _ddp.check_option("comm_hook", HookType.POWER_SGD) == "power_sgd"
    assert _ddp.check_option("comm_wrapper", HookType.FP16) == "fp16"
    assert _ddp.check_option("comm_hook", " FP16 ") == "fp16"
    assert _ddp.check_option("comm_hook", None) == "no"
    assert _ddp.check_option("comm_state_option", None) == {}
    assert _ddp.ddp_options({}, {"comm_state": None, "comm_hook": "fp16"}).comm_state is None
    with pytest.raises(ConfigError, match="unknown DDP option 'dim'"):
        _ddp.check_option("dim", 0)


def test_prepare_model_options_override_run_options_key_by_key() -> None:
    run = {"find_unused_parameters": True, "bucket_cap_mb": 5, "comm_hook": "fp16",
           "lr": 0.1, "comm_state_option": {"matrix_approximation_rank": 4}}
    merged = _ddp.ddp_options(run, {"bucket_cap_mb": 7, "comm_hook": "power_sgd",
                                    "broadcast_buffers": True})
    # broadcast_buffers=True is DDP's default: not passed (newer torch warns when it is)
    assert dict(merged.wrapper) == {"find_unused_parameters": True, "bucket_cap_mb": 7}
    assert merged.comm_hook == "power_sgd"
    assert merged.comm_state_option == {"matrix_approximation_rank": 4}
    assert "lr" not in merged.given
    off = _ddp.ddp_options({}, {"broadcast_buffers": False})
    assert dict(off.wrapper) == {"broadcast_buffers": False}


def test_power_sgd_without_numpy_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(ConfigError, match="needs numpy"):
        _ddp._power_sgd_state({})


def test_power_sgd_state_is_built_from_the_options() -> None:
    pytest.importorskip("numpy")
    state: Any = _ddp._power_sgd_state({"matrix_approximation_rank": 3,
                                        "start_powerSGD_iter": 7})
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (3, 7)
    assert state.process_group is None  # the default group


def test_bf16_hook_and_wrapper_have_no_string_annotations() -> None:
    # DDP compares a hook's annotations with objects; these run where torch's bf16 ones refuse
    import inspect

    assert inspect.signature(_ddp._bf16_compress_hook).parameters["bucket"].annotation is (
        inspect.Parameter.empty
    )
    wrapped = _ddp._bf16_compress_wrapper(_ddp._bf16_compress_hook)
    assert inspect.signature(wrapped).return_annotation is inspect.Signature.empty


# --- the config file ---------------------------------------------------------------------


def test_config_file_accepts_ddp_options() -> None:
    text = (
        "find_unused_parameters = true\nstatic_graph = false\ngradient_as_bucket_view = true\n"
        "bucket_cap_mb = 50\nbroadcast_buffers = false\ncomm_hook = \"POWER_SGD\"\n"
        "comm_wrapper = \"bf16\"\n"
        "comm_state_option = {matrix_approximation_rank = 2, start_powerSGD_iter = 10}\n"
    )
    settings = parse_config(text, "cfg.toml")
    assert settings == {
        "find_unused_parameters": True, "static_graph": False, "gradient_as_bucket_view": True,
        "bucket_cap_mb": 50.0, "broadcast_buffers": False, "comm_hook": "power_sgd",
        "comm_wrapper": "bf16",
        "comm_state_option": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 10},
    }
    assert parse_config(dump_config(settings)) == settings


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("find_unused_parameters = 1", r"find_unused_parameters=1 is invalid.*true or false"),
        ("bucket_cap_mb = 0", r"bucket_cap_mb=0 is invalid.*> 0"),
        ('comm_hook = "powersgd"', r"comm_hook='powersgd' is invalid.*'power_sgd'"),
        ('comm_wrapper = "power_sgd"', r"comm_wrapper='power_sgd' is invalid.*'bf16'\]"),
        ("comm_state_option = 2", r"comm_state_option=2 is invalid.*a dict of PowerSGD"),
        ("comm_state_option = {rank = 2}", r"unknown PowerSGD option 'rank'"),
        ('comm_hook = "no"\ncomm_state = 3', r"unknown setting 'comm_state'"),
    ],
)
def test_config_file_rejects_bad_ddp_values(line: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_config(line, "cfg.toml")
    assert "cfg.toml" in str(info.value)


def test_table_setting_as_text_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"answer: DDP option comm_state_option='\{\}' .* dict"):
        validate_setting("comm_state_option", "{}", "answer")


def test_config_file_options_reach_the_state_and_distributed_wins(
    no_config: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    no_config.write_text('comm_hook = "fp16"\nbucket_cap_mb = 10\nmixed_precision = "no"\n')
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(no_config))
    caplog.set_level(logging.DEBUG, logger="accel.parallel.ddp")
    with accel.distributed(bucket_cap_mb=20, static_graph=True) as st:
        assert dict(st.options) == {"comm_hook": "fp16", "bucket_cap_mb": 20, "static_graph": True}
        with accel.distributed(comm_hook="no") as inner:
            assert inner.options["comm_hook"] == "no"
            assert inner.options["bucket_cap_mb"] == 20
        net = nn.Linear(2, 2)
        assert accel.prepare_model(net) is net  # one process: ignored
    (note,) = _ignored_notes(caplog)
    assert "comm_hook" in note.message and "bucket_cap_mb" in note.message


def test_bad_value_in_config_file_fails_distributed(
    no_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_config.write_text('comm_hook = "fp8"\n')
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(no_config))
    with pytest.raises(ConfigError, match=r"comm_hook='fp8' is invalid"), accel.distributed():
        pass


def test_prepared_model_still_trains_on_one_process(no_config: Path) -> None:
    torch.manual_seed(0)
    with accel.distributed(comm_hook="power_sgd"):
        model = accel.prepare_model(nn.Linear(3, 1), find_unused_parameters=True)
        before = model.weight.detach().clone()
        model(torch.ones(2, 3)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert not torch.equal(before, model.weight)
