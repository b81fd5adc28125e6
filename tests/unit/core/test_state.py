from __future__ import annotations

import contextvars
import threading
from pathlib import Path

import attrs
import pytest
import torch

import accel
from accel.core.env import LaunchEnv
from accel.core.state import ProcessState, resolve_policy
from accel.errors import AccelError, ConfigError
from accel.testing import fake_state


def test_state_is_frozen_and_has_predicates() -> None:
    st = ProcessState(rank=3, local_rank=1, world_size=4, local_world_size=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        st.rank = 0  # type: ignore[misc]
    assert not st.is_main_process and not st.is_local_main_process
    assert st.is_last_process and st.use_distributed
    assert ProcessState().is_main_process and not ProcessState().use_distributed


def test_outside_any_block_is_a_single_process_without_side_effects() -> None:
    st = accel.state()
    assert (st.rank, st.world_size, st.mixed_precision, st.strategy) == (0, 1, "no", "none")
    assert st.device == torch.device("cpu")
    assert not torch.distributed.is_initialized()


def test_outside_a_block_the_launch_environment_decides_gating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    st = accel.state()
    assert (st.rank, st.world_size, st.is_main_process) == (1, 2, False)
    with pytest.raises(accel.errors.NotDistributedError, match=r"accel\.distributed\(\)"):
        accel.gather(torch.zeros(1))


def test_distributed_single_process_sets_and_restores_state() -> None:
    with accel.distributed(mixed_precision="bf16", gradient_accumulation_steps=4) as st:
        assert accel.state() is st
        assert (st.world_size, st.backend, st.mixed_precision) == (1, None, "bf16")
        assert st.gradient_accumulation_steps == 4 and st.strategy == "none"
        assert not torch.distributed.is_initialized()
    assert accel.state().mixed_precision == "no"


def test_nested_block_scopes_changed_options_only() -> None:
    with accel.distributed(
        mixed_precision="bf16", gradient_accumulation_steps=2, bucket_cap_mb=5
    ) as outer:
        with accel.distributed(mixed_precision="no", static_graph=True) as inner:
            assert inner.mixed_precision == "no"
            assert inner.gradient_accumulation_steps == 2
            assert dict(inner.options) == {"bucket_cap_mb": 5, "static_graph": True}
            assert accel.state() is inner
        assert accel.state() is outer and outer.mixed_precision == "bf16"


def test_nested_block_cannot_change_the_group() -> None:
    with accel.distributed(), pytest.raises(ConfigError, match="nested"):  # noqa: SIM117
        with accel.distributed(backend="nccl"):
            pass


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mixed_precision": "fp32"}, "mixed_precision='fp32'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
        ({"strategy": "zero3"}, "strategy='zero3'"),
        ({"timeout": -1}, "timeout=-1"),
        ({"arrival_timeout": 0}, "arrival_timeout=0"),
        ({"arrival_timeout": "soon"}, "arrival_timeout='soon'"),
    ],
)
def test_bad_options_are_clear_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info, accel.distributed(**kwargs):  # type: ignore[arg-type]
        pass
    assert isinstance(info.value, AccelError) and isinstance(info.value, ValueError)
    assert "e.g." in str(info.value)


def test_environment_fills_options_not_passed() -> None:
    env = LaunchEnv(mixed_precision="fp16", gradient_accumulation_steps=3, debug=True,
                    arrival_timeout=20.0)
    policy = resolve_policy(env, world_size=2)
    assert policy == {
        "mixed_precision": "fp16",
        "gradient_accumulation_steps": 3,
        "strategy": "ddp",
        "debug": True,
        "timeout": 1800.0,
        "arrival_timeout": 20.0,
    }
    assert resolve_policy(LaunchEnv(), world_size=2)["arrival_timeout"] == 300.0
    explicit = resolve_policy(env, world_size=2, mixed_precision="bf16", debug=False)
    assert explicit["mixed_precision"] == "bf16" and explicit["debug"] is False


def test_state_does_not_leak_into_new_threads_but_copy_context_carries_it() -> None:
    seen: dict[str, int] = {}
    with fake_state(rank=1, world_size=2):

        def read(key: str) -> None:
            seen[key] = accel.state().rank

        plain = threading.Thread(target=read, args=("plain",))
        plain.start()
        plain.join()
        ctx = contextvars.copy_context()
        copied = threading.Thread(target=ctx.run, args=(read, "copied"))
        copied.start()
        copied.join()
    assert seen == {"plain": 0, "copied": 1}


def test_config_file_fills_what_the_environment_leaves_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('mixed_precision = "bf16"\ngradient_accumulation_steps = 3\n')
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    with accel.distributed() as st:
        assert (st.mixed_precision, st.gradient_accumulation_steps) == ("bf16", 3)
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp16")  # environment beats the file
    with accel.distributed(gradient_accumulation_steps=5) as st:  # argument beats both
        assert (st.mixed_precision, st.gradient_accumulation_steps) == ("fp16", 5)
