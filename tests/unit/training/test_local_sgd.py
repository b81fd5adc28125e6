"""accel.LocalSGD on one process (no-op), its argument checks and its error paths (faked ranks)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch._dynamo  # imported here: it sets TORCHINDUCTOR_CACHE_DIR (conftest env guard)
from torch import nn

import accel
from accel.errors import ConfigError, GatedCollectiveError, NotDistributedError
from accel.testing import fake_state
from accel.training import local_sgd as local_sgd_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def _train(model: nn.Module, steps: int, local_sgd: accel.LocalSGD | None = None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=generator)
        loss = model(x).pow(2).mean()
        accel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if local_sgd is not None:
            local_sgd.step()


def test_one_process_is_a_passthrough() -> None:
    plain = _model()
    _train(plain, 7)
    model = _model()
    with fake_state(), accel.LocalSGD(model=model, local_sgd_steps=2) as local_sgd:
        assert local_sgd.enabled is False  # one process: nothing to average
        _train(model, 7, local_sgd)
    assert local_sgd.num_steps == 7
    assert local_sgd.local_sgd_steps == 2
    assert local_sgd.model is model
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_disabled_accepts_none_steps_and_only_counts() -> None:
    # Accelerate's example: LocalSGD(..., local_sgd_steps=None, enabled=local_sgd_steps is not None)
    model = _model()
    before = copy.deepcopy(model)
    with fake_state(rank=0, world_size=2):  # no process group: a collective would raise
        with accel.LocalSGD(model=model, local_sgd_steps=None, enabled=False) as local_sgd:
            for _ in range(5):
                local_sgd.step()
        assert local_sgd.enabled is False
        assert local_sgd.num_steps == 5
        assert local_sgd.local_sgd_steps is None
        with accel.LocalSGD(model, 1, enabled=False) as other:  # positional form
            other.step()
    for p, q in zip(before.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_enabled_on_several_processes() -> None:
    with fake_state(rank=1, world_size=3):
        local_sgd = accel.LocalSGD(model=_model(), local_sgd_steps=4)
    assert local_sgd.enabled is True
    assert local_sgd.num_steps == 0


@pytest.mark.parametrize("steps", [0, -3, 2.5, True, "8", None, [8]])
def test_bad_local_sgd_steps(steps: Any) -> None:
    with pytest.raises(ConfigError, match="local_sgd_steps") as info:
        accel.LocalSGD(model=_model(), local_sgd_steps=steps)
    message = str(info.value)
    assert repr(steps) in message
    assert "positive int" in message
    assert "accel.LocalSGD(model=model, local_sgd_steps=8)" in message


def test_bad_local_sgd_steps_is_refused_when_disabled_too() -> None:
    with pytest.raises(ConfigError, match=r"local_sgd_steps=0\)"):
        accel.LocalSGD(model=_model(), local_sgd_steps=0, enabled=False)


@pytest.mark.parametrize("enabled", ["yes", None, 1])
def test_bad_enabled(enabled: Any) -> None:
    with pytest.raises(ConfigError, match="enabled") as info:
        accel.LocalSGD(model=_model(), local_sgd_steps=2, enabled=enabled)
    assert repr(enabled) in str(info.value)
    assert "True or False" in str(info.value)


@pytest.mark.parametrize("model", ["model", None, [nn.Parameter(torch.ones(2))]])
def test_model_must_be_a_module(model: Any) -> None:
    with pytest.raises(ConfigError, match=r"torch\.nn\.Module") as info:
        accel.LocalSGD(model=model, local_sgd_steps=2)
    assert type(model).__name__ in str(info.value)
    assert "accel.prepare_model(model)" in str(info.value)


def test_fsdp_strategy_is_refused_even_when_disabled() -> None:
    with fake_state(strategy="fsdp"), pytest.raises(ConfigError, match="strategy='fsdp'") as info:
        accel.LocalSGD(model=_model(), local_sgd_steps=2, enabled=False)
    assert "strategy='ddp'" in str(info.value)


class _FakeFullyShardedModule(nn.Linear):
    """Has what FSDP2's FSDPModule has that LocalSGD looks at."""

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        pass


def test_sharded_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="_FakeFullyShardedModule"):
        accel.LocalSGD(model=_FakeFullyShardedModule(2, 2), local_sgd_steps=2)


def test_original_module_resolves_to_the_prepared_model() -> None:
    net = _model()
    with fake_state():
        prepared = accel.prepare_model(net, compile={"backend": "eager"})
        assert prepared is not net
        local_sgd = accel.LocalSGD(model=net, local_sgd_steps=2)
        assert local_sgd.model is prepared
        assert accel.LocalSGD(model=prepared, local_sgd_steps=2).model is prepared


def test_averaging_needs_a_process_group() -> None:
    model = _model()
    with fake_state(rank=0, world_size=2):
        local_sgd = accel.LocalSGD(model=model, local_sgd_steps=3)
        local_sgd.step()
        local_sgd.step()  # not an averaging step: no collective
        with pytest.raises(NotDistributedError, match=r"LocalSGD\.step"):
            local_sgd.step()
    assert local_sgd.num_steps == 3


def test_normal_exit_averages_but_an_exception_makes_no_collective() -> None:
    with fake_state(rank=0, world_size=2):
        with pytest.raises(NotDistributedError), accel.LocalSGD(model=_model(), local_sgd_steps=5):
            pass  # leaving the block averages: here that needs the missing group
        with pytest.raises(KeyError, match="users"), accel.LocalSGD(
            model=_model(), local_sgd_steps=5
        ):
            raise KeyError("users")  # propagated as is: no averaging on the exception path


def test_averaging_inside_a_gate_raises_at_once() -> None:
    local_sgd_ref: list[accel.LocalSGD] = []

    @accel.on_main_process
    def gated_step() -> None:
        local_sgd_ref[0].step()

    with fake_state(rank=0, world_size=2):
        local_sgd_ref.append(accel.LocalSGD(model=_model(), local_sgd_steps=1))
        with pytest.raises(GatedCollectiveError, match=r"LocalSGD\.step.*on_main_process"):
            gated_step()


def test_buckets_keep_order_and_split_by_dtype_device_and_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(local_sgd_module, "_BUCKET_BYTES", 40)
    params = [
        torch.zeros(4),  # 16 bytes
        torch.zeros(4),  # 32
        torch.zeros(4),  # 48 > 40: new bucket
        torch.zeros(2, dtype=torch.float64),  # new dtype: new bucket
        torch.zeros(20),  # 80 bytes alone (bigger than a bucket: a bucket of its own)
        torch.zeros(1),
    ]
    buckets = list(local_sgd_module._buckets(params))
    assert [len(b) for b in buckets] == [2, 1, 1, 1, 1]
    flat = [p for bucket in buckets for p in bucket]
    assert all(p is q for p, q in zip(flat, params, strict=True))
    assert all(len({p.dtype for p in bucket}) == 1 for bucket in buckets)
