"""The DeepSpeed config a run uses (accel.parallel.deepspeed.config): shortcuts, every "auto"
filled from accel's settings, contradictions and leftovers refused. Nothing imports deepspeed
here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from accel.errors import ConfigError
from accel.parallel.deepspeed.config import (
    Facts,
    build_config,
    load_config,
    partition_config,
    resolve_config,
)


def _facts(**changes: Any) -> Facts:
    base: dict[str, Any] = {"mixed_precision": "no", "gradient_accumulation_steps": 2,
                            "world_size": 4, "micro_batch": 8}
    return Facts(**{**base, **changes})


def test_every_auto_is_filled_from_accels_settings() -> None:
    config = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": 0},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }
    out = resolve_config(config, _facts(mixed_precision="bf16", gradient_clipping=1.0,
                                        hidden_size=64))
    resolved = dict(out.config)
    assert resolved["train_micro_batch_size_per_gpu"] == 8
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 8 * 2 * 4
    assert resolved["gradient_clipping"] == 1.0 and not out.clip_from_loop
    assert resolved["bf16"] == {"enabled": True}
    assert resolved["fp16"] == {"enabled": False, "loss_scale": 0}
    zero = resolved["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (4096, 3686, 640)
    assert resolved["zero_allow_untested_optimizer"] is True
    assert config["train_batch_size"] == "auto"  # the user's dict is not changed


def test_missing_keys_and_the_loops_clip() -> None:
    out = resolve_config({}, _facts(mixed_precision="fp16"))
    assert out.clip_from_loop and out.config["gradient_clipping"] == 0.0
    assert out.config["fp16"] == {"enabled": True} and "bf16" not in out.config
    derived = resolve_config({"train_batch_size": 128}, _facts(micro_batch=None))
    assert derived.config["train_micro_batch_size_per_gpu"] == 16


@pytest.mark.parametrize(("config", "facts", "words"), [
    ({"gradient_accumulation_steps": 4}, {}, "gradient_accumulation_steps=4 differs from "
     "accel's gradient_accumulation_steps=2"),
    ({"train_batch_size": 10}, {}, "train_batch_size=10 is not"),
    ({}, {"micro_batch": None}, "train_micro_batch_size_per_gpu is \"auto\""),
    ({"bf16": {"enabled": True}}, {}, "bf16.enabled=True contradicts mixed_precision='no'"),
    ({"fp16": {"enabled": False}}, {"mixed_precision": "fp16"}, "fp16.enabled=False"),
    ({}, {"mixed_precision": "fp8"}, "fp8"),
    ({"gradient_clipping": 1.0}, {"gradient_clipping": 0.5}, "contradicts the DeepSpeed"),
    ({"gradient_clipping": -1}, {}, "must be a number >= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, {}, "\"optimizer\" section"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, {"client_optimizer": False},
     "['optimizer.params.lr']"),
    ({"scheduler": {"params": {"warmup_num_steps": "auto"}}}, {},
     "['scheduler.params.warmup_num_steps']"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, {},
     "['zero_optimization.reduce_bucket_size']"),
])
def test_contradictions_and_unfilled_autos_are_refused_naming_the_key(
    config: dict[str, Any], facts: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(config, _facts(**facts))
    assert words in str(info.value), str(info.value)


def test_shortcuts_build_or_check_the_config(tmp_path: Path) -> None:
    built = build_config(None, zero_stage=3, offload_optimizer="cpu", offload_params="cpu")
    assert built == {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2,
                                                      "offload_optimizer": {"device": "cpu",
                                                                            "pin_memory": True}}}))
    assert load_config(path)["zero_optimization"]["stage"] == 2
    same = build_config(str(path), zero_stage=2, offload_optimizer="cpu")
    assert same["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    with pytest.raises(ConfigError, match=r"zero_stage=3 contradicts .*stage=2"):
        build_config(path, zero_stage=3)
    with pytest.raises(ConfigError, match=r"offload_optimizer='nvme' contradicts"):
        build_config(path, offload_optimizer="nvme")
    with pytest.raises(ConfigError, match=r"zero_stage=7 is invalid"):
        build_config(None, zero_stage=7)
    with pytest.raises(ConfigError, match=r"cannot be read"):
        build_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"holds a list"):
        build_config(tmp_path / "bad.json")
    # a torch optimizer on offloaded states: no DeepSpeedCPUAdam (a C++ build) is forced
    offloaded = resolve_config(built, _facts()).config
    assert offloaded["zero_force_ds_cpu_optimizer"] is False


def test_the_partition_config_is_what_zero_init_reads_before_the_loader_exists() -> None:
    config = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto",
                              "offload_param": {"device": "cpu"}},
    }
    out = partition_config(config, _facts(mixed_precision="bf16", micro_batch=None))
    assert out == {  # a placeholder micro batch; the other "auto"s left to DeepSpeed
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    assert partition_config({"train_micro_batch_size_per_gpu": 4}, _facts())[
        "train_micro_batch_size_per_gpu"] == 4
    with pytest.raises(ConfigError, match=r"bf16.enabled=False contradicts"):
        partition_config({"bf16": {"enabled": False}}, _facts(mixed_precision="bf16"))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="needs the deepspeed extra")
def test_init_partitioned_refuses_what_prepare_would_and_is_a_no_op_outside_zero3() -> None:
    with accel.distributed(strategy="deepspeed", zero_stage=3, mixed_precision="bf16",
                           deepspeed_config={"bf16": {"enabled": False}}), \
            pytest.raises(ConfigError, match=r"contradicts mixed_precision='bf16'"), \
            accel.init_partitioned():
        pass
    for options in ({}, {"strategy": "deepspeed", "zero_stage": 2}):
        with accel.distributed(**options), accel.init_partitioned():
            assert not hasattr(torch.nn.Linear(2, 2).weight, "ds_id")
    with accel.init_partitioned():  # no block
        assert not hasattr(torch.nn.Linear(2, 2).weight, "ds_id")


def test_strategy_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'accel\[deepspeed\]'"), \
            accel.distributed(strategy="deepspeed"):
        pass


def test_unknown_option_names_the_closest_and_import_stays_light() -> None:
    with pytest.raises(ConfigError, match="did you mean 'zero_stage'"), \
            accel.distributed(zero_stag=2):
        pass
    code = ("import sys, accel\nwith accel.distributed(): pass\n"
            "print('deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "False"


def test_the_deepspeed_config_gives_the_precision_and_accumulation_nothing_else_gave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import accel
    from accel.core.config_file import deepspeed_policy

    config = {"bf16": {"enabled": True}, "fp16": {"enabled": "auto"},
              "gradient_accumulation_steps": 2}
    assert deepspeed_policy(config) == {"mixed_precision": "bf16",
                                        "gradient_accumulation_steps": 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert deepspeed_policy(str(path)) == deepspeed_policy(config)
    assert deepspeed_policy({"bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto"}
                            ) == {}
    assert deepspeed_policy(str(tmp_path / "missing.json")) == {}  # the engine says what is wrong
    for name in ("ACCEL_MIXED_PRECISION", "ACCEL_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "empty.toml").write_text("")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(tmp_path / "empty.toml"))  # no user file
    with accel.distributed(cpu=True, strategy="deepspeed", deepspeed_config=str(path)) as st:
        assert (st.mixed_precision, st.gradient_accumulation_steps) == ("bf16", 2)
    with accel.distributed(cpu=True, strategy="deepspeed", deepspeed_config=config,
                           mixed_precision="no") as st:  # an argument wins (then the engine
        assert (st.mixed_precision, st.gradient_accumulation_steps) == ("no", 2)  # refuses)
    monkeypatch.setenv("ACCEL_GRADIENT_ACCUMULATION_STEPS", "4")
    with accel.distributed(cpu=True, strategy="deepspeed", deepspeed_config=config) as st:
        assert st.gradient_accumulation_steps == 4  # the environment wins too
