"""A misspelt option is refused with the closest known name, never run with a default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import accel
from accel.errors import CheckpointArgumentError, ConfigError


def test_distributed_refuses_unknown_keywords_naming_the_closest() -> None:
    typo = r"'mixed_precison' \(did you mean 'mixed_precision'\?\)"
    with pytest.raises(ConfigError, match=typo), accel.distributed(mixed_precison="bf16"):
        pass
    with pytest.raises(ConfigError, match=r"'tp_sise' \(did you mean 'tp_size'\?\)"), \
            accel.distributed(tp_sise=2):
        pass
    with pytest.raises(ConfigError, match=r"tp_size=2 \(world_size=1\) do not divide"), \
            accel.distributed(tp_size=2):  # a real option now: checked against the world
        pass
    with accel.distributed(find_unused_parameters=True, shard_modules="Linear") as st:
        assert dict(st.options) == {"find_unused_parameters": True, "shard_modules": "Linear"}
        with pytest.raises(ConfigError, match="did you mean 'bucket_cap_mb'"), accel.distributed(
            bucket_cap_m=4  # nested too
        ):
            pass


def test_prepare_model_names_the_closest_strategy_option() -> None:
    with pytest.raises(ConfigError, match="did you mean 'reshard_after_forward'"):
        accel.prepare_model(torch.nn.Linear(2, 2), strategy="fsdp", reshard_after_forwards=True)
    with pytest.raises(ConfigError, match="did you mean 'find_unused_parameters'"):
        accel.prepare_model(torch.nn.Linear(2, 2), find_unused_parameter=True)


def test_prepare_model_refuses_a_compile_mode_it_does_not_have() -> None:
    with pytest.raises(ConfigError, match="did you mean 'regional'"):
        accel.prepare_model(torch.nn.Linear(2, 2), compile="regionl")  # type: ignore[arg-type]


def test_save_and_load_state_name_a_misspelt_option(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointArgumentError, match="did you mean 'total_limit'"):
        accel.save_state(tmp_path, step=1, total_limt=3, model=model)
    assert not any(tmp_path.iterdir())  # nothing written
    with pytest.raises(CheckpointArgumentError, match="did you mean 'missing_ok'"):
        accel.load_state(tmp_path, missing_okk=True, model=model)


def test_notebook_launcher_refuses_unknown_options() -> None:
    with pytest.raises(ConfigError, match="did you mean 'mixed_precision'"):
        accel.notebook_launcher(lambda: None, num_processes=1, mixed_precison="bf16")


def test_config_file_refuses_unknown_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('mixed_precison = "bf16"\n')
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    with pytest.raises(ConfigError, match="did you mean 'mixed_precision'"), accel.distributed():
        pass
