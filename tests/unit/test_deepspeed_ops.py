"""Which DeepSpeed C++ ops a config makes DeepSpeed compile, the CPU default that needs none,
and the warnings (once per op; a stale build lock named)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from accel.parallel.deepspeed import ops


def _adam(**params: Any) -> dict[str, Any]:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


def test_a_cpu_config_adam_becomes_torch_adam_unless_the_config_says() -> None:
    assert ops.prefer_torch_adam(_adam(), "cpu")["optimizer"]["params"]["torch_adam"] is True
    assert ops.prefer_torch_adam(_adam(torch_adam=False), "cpu") == _adam(torch_adam=False)
    assert ops.prefer_torch_adam(_adam(), "cuda") == _adam()  # DeepSpeed's fused kernel on GPUs
    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    assert ops.prefer_torch_adam(lamb, "cpu") == lamb
    config = _adam()
    ops.prefer_torch_adam(config, "cpu")
    assert "torch_adam" not in config["optimizer"]["params"]  # the user's dict is not changed


@pytest.mark.parametrize(
    ("config", "client", "expected"),
    [
        ({}, True, []),
        (_adam(), False, ["fused_adam"]),
        (_adam(torch_adam=True), False, []),
        ({**_adam(), "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, False,
         ["cpu_adam"]),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, True, ["cpu_adam"]),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}},
          "zero_force_ds_cpu_optimizer": False}, True, []),
        ({"optimizer": {"type": "Lion"}}, False, ["fused_lion"]),
        ({"optimizer": {"type": "Adagrad"}}, False, []),
        ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, True, ["async_io"]),
    ],
)
def test_needed_ops(config: dict[str, Any], client: bool, expected: list[str]) -> None:
    assert ops.needed_ops(config, client_optimizer=client) == expected


def test_a_build_is_announced_once_and_a_stale_lock_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"compile its C\+\+ op 'fused_adam'.*3-4 minutes"):
        assert ops.warn_builds(_adam(), client_optimizer=False) == ["fused_adam"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.warn_builds(_adam(), client_optimizer=False)  # once per process
        assert ops.warn_builds(_adam(torch_adam=True), client_optimizer=False) == []
    (tmp_path / "fused_lamb").mkdir()
    (tmp_path / "fused_lamb" / "lock").touch()
    with pytest.warns(RuntimeWarning, match="build lock at .*fused_lamb.*waits on it forever"):
        ops.warn_builds({"optimizer": {"type": "Lamb"}}, client_optimizer=False)
    assert not (tmp_path / "fused_adam").exists()  # nothing created
