"""The settings digest (``accel.core.agreement``): stable descriptions, the message that
names each key and each rank's value, one exchange per call (a second only on a difference).
Real processes: tests/multiproc/test_settings_agreement.py.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from pathlib import Path

import pytest
import torch
from torch import nn

import accel
from accel.core.agreement import (
    agree_on_settings,
    agreed_once,
    describe,
    disagreement,
    settings_of,
)
from accel.core.state import gated
from accel.errors import ConfigError
from accel.testing import fake_state


class Recipe(enum.Enum):
    ROWWISE = "rowwise"


@dataclasses.dataclass(frozen=True)
class Config:
    recipe: Recipe = Recipe.ROWWISE
    dtype: torch.dtype = torch.bfloat16


def _filter(module: nn.Module, name: str) -> bool:
    return "head" not in name


def test_values_are_described_by_stable_text() -> None:
    got = describe({
        "plan": ("layers.1", "layers.3"), "hook": _filter, "cls": nn.Linear, "path": Path("/x"),
        "config": Config(), "set": {3, 1}, "module": nn.Linear(2, 2),
        "partial": functools.partial(_filter, name="x"), "nested": {1: {"a": [1.5, None]}},
    })
    assert got == {
        "plan": ["layers.1", "layers.3"],
        "hook": f"{__name__}._filter",
        "cls": "torch.nn.modules.linear.Linear",
        "path": "/x",
        "config": {"type": f"{__name__}.Config", "recipe": "Recipe.ROWWISE",
                   "dtype": "torch.bfloat16"},
        "set": [1, 3],
        "module": "<torch.nn.modules.linear.Linear object>",  # contents not compared
        "partial": "<functools.partial object>",
        "nested": {"1": {"a": [1.5, None]}},
    }
    deep: list[object] = []
    deep.append(deep)  # a cycle ends at the depth bound
    assert "nested deeper than" in str(describe(deep))


def test_the_message_names_each_key_and_rank_value() -> None:
    seen = [
        {"pp_schedule": "1F1B", "microbatches": 4, "deepspeed": {"zero": {"stage": 2}}},
        {"pp_schedule": "GPipe", "microbatches": 4, "deepspeed": {"zero": {"stage": 3}}},
        {"pp_schedule": "GPipe", "microbatches": 4, "deepspeed": {"zero": {"stage": 3}},
         "extra": True},
    ]
    message = disagreement("accel.prepare_model()", seen)
    assert message is not None
    assert message.startswith(
        "accel.prepare_model(): ranks disagree on pp_schedule: rank 0 '1F1B', ranks 1-2 "
        "'GPipe'; on deepspeed.zero.stage: rank 0 2, ranks 1-2 3; on extra: ranks 0-1 "
        "<not set>, rank 2 True."
    )
    assert "microbatches" not in message
    assert "`pp_schedule = '1F1B'`" in message
    assert disagreement("accel.distributed()", [seen[0], dict(seen[0])]) is None


def test_many_ranks_and_values_are_bounded() -> None:
    seen = [{"microbatches": rank, "long": "x" * 1000} for rank in range(64)]
    message = disagreement("accel.prepare_model()", seen)
    assert message is not None
    assert "56 more values" in message and len(message) < 2000


def test_settings_of_the_state_cover_policy_mesh_and_options() -> None:
    with fake_state(rank=1, world_size=4, mixed_precision="bf16",
                    options={"zero_stage": 3, "fp8_module_filter": _filter}):
        got = settings_of(accel.state())
    assert got["mixed_precision"] == "bf16" and got["zero_stage"] == 3
    assert got["fp8_module_filter"] == f"{__name__}._filter"
    assert "rank" not in got and "seed" not in got and "timeout" not in got


def test_one_process_and_gated_regions_exchange_nothing() -> None:
    cpu = torch.device("cpu")
    # no process group (a faked rank of 4 included): nothing to agree with, no collective
    with fake_state(rank=1, world_size=4):
        assert agree_on_settings("accel.prepare_model()", {"x": object()}, device=cpu) is None
        with gated("accel.on_main_process"):
            assert agree_on_settings("accel.prepare_model()", {"x": 1}, device=cpu) is None


class _FakeWorld:
    """Two ranks in one process (``torch.distributed``'s calls patched for the test): rank 1's
    payloads are made from ``other``'s values."""

    def __init__(self, other: dict[str, object]) -> None:
        from accel.core import agreement

        self.other = agreement._canonical(other)
        self.calls = 0

    def all_gather(self, out: list[torch.Tensor], mine: torch.Tensor) -> None:
        from accel.core import agreement

        self.calls += 1
        out[0].copy_(mine)
        if mine.dtype == torch.int64:  # the digest
            out[1].copy_(agreement._digest(self.other, mine.device))
        else:  # the texts, padded to the longest
            out[1].zero_()
            out[1][: len(self.other)] = torch.tensor(list(self.other), dtype=torch.uint8)


def _fake_world(monkeypatch: pytest.MonkeyPatch, other: dict[str, object]) -> _FakeWorld:
    from accel.core import agreement

    world = _FakeWorld(other)
    for name, value in {"is_initialized": lambda: True, "get_world_size": lambda: 2,
                        "get_backend": lambda: "gloo", "all_gather": world.all_gather}.items():
        monkeypatch.setattr(agreement.dist, name, value)
    return world


def test_one_exchange_when_ranks_agree_and_a_second_to_name_a_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    world = _fake_world(monkeypatch, {"pp_schedule": "1F1B"})  # torch.distributed, patched
    with fake_state(rank=0, world_size=2):
        with agreed_once("accel.prepare()", {"pp_schedule": "1F1B"}, device=cpu):
            agree_on_settings("accel.prepare_model()", {"pp_schedule": "GPipe"}, device=cpu)
        assert world.calls == 1  # the call inside agreed_once was covered by it
        with pytest.raises(ConfigError, match=r"accel.prepare_model\(\): ranks disagree on "
                           r"pp_schedule: rank 0 'GPipe', rank 1 '1F1B'"):
            agree_on_settings("accel.prepare_model()", {"pp_schedule": "GPipe"}, device=cpu)
    assert world.calls == 3  # the digest, then the texts
