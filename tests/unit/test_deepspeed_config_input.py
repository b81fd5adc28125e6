"""The user's DeepSpeed config as untrusted input (issue 40): the file read bounded (size,
nesting, regular files only, UTF-8, no key twice), every key checked against what the installed
DeepSpeed reads (top level and nested, naming the closest known name), booleans not taken for
numbers, and DeepSpeed's own validation errors turned into a ConfigError naming the key."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accel.core.config_file import deepspeed_policy
from accel.errors import ConfigError
from accel.parallel.deepspeed.config import Facts, load_config, partition_config, resolve_config

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs the deepspeed extra")

HF_ZERO3 = {  # transformers' ZeRO-3 template, as users copy it
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
    "activation_checkpointing": {"partition_activations": False},
    "tensorboard": {"enabled": False, "output_path": "runs/"},
}


def _facts(**changes: Any) -> Facts:
    base: dict[str, Any] = {"mixed_precision": "no", "gradient_accumulation_steps": 2,
                            "world_size": 2, "micro_batch": 4}
    return Facts(**{**base, **changes})


def _refused(config: dict[str, Any], *words: str) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(config, _facts())
    assert type(info.value).__module__.startswith("accel"), type(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return str(info.value)


# -- keys checked against the installed DeepSpeed ---------------------------------------------


@needs_deepspeed
@pytest.mark.parametrize(("config", "words"), [
    ({"zero_optimisation": {"stage": 3}},
     ("'zero_optimisation'", "did you mean 'zero_optimization'")),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_acumulation_steps": 2},
     ("'gradient_acumulation_steps'", "did you mean 'gradient_accumulation_steps'")),
    ({"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}},
     ("zero_optimization.offload_optimiser", "did you mean 'offload_optimizer'")),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
     ("zero_optimization.offload_param.pin_memroy", "did you mean 'pin_memory'")),
    ({"activation_checkpointing": {"partition_activation": True}},
     ("activation_checkpointing.partition_activation", "did you mean 'partition_activations'")),
    ({"tensorboard": {"enabled": False, "output_pth": "runs/"}},
     ("tensorboard.output_pth", "did you mean 'output_path'")),
    ({"fp16": {"enabled": "auto", "loss_scale_windw": 100}},
     ("fp16.loss_scale_windw", "did you mean 'loss_scale_window'")),
])
def test_an_unknown_key_is_refused_naming_its_path_and_the_closest_known_name(
    config: dict[str, Any], words: tuple[str, ...]
) -> None:
    _refused(config, *words, "`")
    with pytest.raises(ConfigError, match=words[0].replace(".", r"\.")):
        partition_config(config, _facts())  # what accel.init_partitioned hands to zero.Init


@needs_deepspeed
def test_a_misspelt_key_stops_the_block_before_deepspeed_starts() -> None:
    import accel

    config = {"zero_optimization": {"stage": 3, "offload_parm": {"device": "cpu"}}}
    with accel.distributed(strategy="deepspeed", deepspeed_config=config), \
            pytest.raises(ConfigError, match=r"zero_optimization\.offload_parm.*'offload_param'"), \
            accel.init_partitioned():
        pass


@needs_deepspeed
def test_known_keys_autos_and_the_keys_accel_adds_still_pass() -> None:
    out = resolve_config(HF_ZERO3, _facts(mixed_precision="bf16", hidden_size=8)).config
    assert out["zero_optimization"]["stage"] == 3 and out["bf16"] == {"enabled": True}
    assert out["zero_allow_untested_optimizer"] is True  # accel's own additions pass
    assert out["zero_force_ds_cpu_optimizer"] is False
    config_optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    assert "optimizer" in resolve_config(config_optimizer, _facts(client_optimizer=False)).config
    assert partition_config(HF_ZERO3, _facts())["zero_optimization"]["stage"] == 3


@needs_deepspeed
@pytest.mark.parametrize(("config", "words"), [
    ({"zero_optimization": {"stage": True}}, ("zero_optimization.stage=True", "0, 1, 2 or 3")),
    ({"gradient_predivide_factor": True}, ("gradient_predivide_factor=True", "a number")),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": False}},
     ("zero_optimization.stage3_max_live_parameters=False",)),
    ({"fp16": {"enabled": True, "loss_scale_window": True}},
     ("fp16.loss_scale_window=True",)),
])
def test_a_boolean_is_not_taken_for_a_number(config: dict[str, Any], words: tuple[str, ...]
                                             ) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(config, _facts(mixed_precision="fp16" if "fp16" in config else "no"))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@needs_deepspeed
def test_deepspeeds_own_validation_errors_name_the_key_and_the_value() -> None:
    text = _refused({"zero_optimization": {"stage": 7}}, "zero_optimization.stage=7")
    assert "ValidationError" not in text and "pydantic" not in text
    _refused({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}},
             "zero_optimization.offload_optimizer.device='disk'")
    _refused({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}},
             "zero_optimization.reduce_bucket_size='big'")
    _refused({"fp16": {"enabled": True, "loss_scale_window": -3.5}, "bf16": {"enabled": True}})


# -- the file read bounded --------------------------------------------------------------------


def _file(tmp_path: Path, data: bytes, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _load_refused(path: object, *words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert deepspeed_policy(path) == {}  # the policy reader stays silent on the same input


def test_a_key_twice_is_refused_naming_it(tmp_path: Path) -> None:
    path = _file(tmp_path, b'{"zero_optimization": {"stage": 3, "stage": 0}}')
    _load_refused(path, "'stage' twice", str(path))
    _load_refused(_file(tmp_path, b'{"bf16": {"enabled": true}, "bf16": {}}', "b.json"),
                  "'bf16' twice")


def test_text_that_is_not_utf8_json_is_a_clear_error(tmp_path: Path) -> None:
    utf16 = _file(tmp_path, json.dumps({"bf16": {"enabled": True}}).encode("utf-16"))
    _load_refused(utf16, "UTF-8", "save it as UTF-8")
    _load_refused(_file(tmp_path, b'{"gradient_clipping": NaN}', "nan.json"), "NaN")
    _load_refused(_file(tmp_path, b"[1, 2]", "list.json"), "holds a list")


def test_deep_nesting_is_refused_without_recursion(tmp_path: Path) -> None:
    deep = _file(tmp_path, b"[" * 10**6 + b"]" * 10**6)
    _load_refused(deep, "nest more than")
    inside = _file(tmp_path, b'{"a": ' + b"[" * 10**5 + b"]" * 10**5 + b"}", "inside.json")
    _load_refused(inside, "nest more than")
    nested: dict[str, Any] = {}
    node = nested
    for _ in range(10**5):  # a dict given in code, as deep
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ConfigError, match="nest more than"):
        load_config(nested)
    assert deepspeed_policy(nested) == {}


def test_a_file_over_the_size_bound_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import accel.core.config_file as config_file

    path = _file(tmp_path, json.dumps({"steps_per_print": 10, "pad": "x" * 5000}).encode())
    monkeypatch.setattr(config_file, "DEEPSPEED_CONFIG_MAX_BYTES", 4096)
    _load_refused(path, "more than 4096 bytes", str(path))
    assert config_file.DEEPSPEED_CONFIG_MAX_BYTES == 4096
    _load_refused(tmp_path, "a directory")
    _load_refused(tmp_path / "missing.json", "cannot be read")


_CHILD = r"""
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from accel.core.config_file import deepspeed_policy
from accel.parallel.deepspeed.config import load_config
out = {}
for path in sys.argv[1:]:
    try:
        load_config(path)
        out[path] = "read"
    except Exception as exc:
        out[path] = f"{type(exc).__name__}: {exc}"
    out[path + " policy"] = repr(deepspeed_policy(path))
print(json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"),
                    reason="needs FIFOs and /dev/zero")
def test_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    paths = [str(fifo), "/dev/zero", str(link)]
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, *paths], capture_output=True,
                              text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("a FIFO or /dev/zero as the DeepSpeed config hung its reader")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out[str(fifo)].startswith("ConfigError") and "FIFO" in out[str(fifo)], out
    for path in paths[1:]:
        assert out[path].startswith("ConfigError") and "device" in out[path], out
    assert all(out[p + " policy"] == "{}" for p in paths), out
