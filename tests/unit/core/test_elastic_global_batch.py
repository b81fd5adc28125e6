"""keep_global_batch: the accumulation maths, its error, where the option comes from (keyword,
ACCEL_* variable, config file, `accel launch`), and the scheduler's steps per optimizer step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import accel
from accel.cli.main import build_parser
from accel.core.env import LaunchEnv
from accel.core.global_batch import keep_global_batch, reference_world, scaled_accumulation
from accel.errors import ConfigError
from accel.launch.run import plan_launch
from accel.testing import fake_state


@given(steps=st.integers(1, 16), reference=st.integers(1, 64), world=st.integers(1, 64))
def test_scaled_accumulation_keeps_the_global_batch_or_names_both_sizes(
    steps: int, reference: int, world: int
) -> None:
    batches = steps * reference
    if batches % world == 0:
        scaled = scaled_accumulation(steps, reference=reference, world_size=world)
        assert scaled * world == batches and scaled >= 1
    else:
        with pytest.raises(ConfigError) as caught:
            scaled_accumulation(steps, reference=reference, world_size=world)
        text = str(caught.value)
        assert f"keep_global_batch={reference}" in text
        assert f"world size {world}" in text and f"{reference} processes" in text


def test_examples_and_the_message() -> None:
    assert scaled_accumulation(1, reference=2, world_size=1) == 2
    assert scaled_accumulation(3, reference=4, world_size=2) == 6
    assert scaled_accumulation(4, reference=4, world_size=4) == 4
    with pytest.raises(ConfigError, match=r"world size 3.*among \[1, 2, 4\]"):
        scaled_accumulation(1, reference=4, world_size=3)
    assert reference_world({}) is None
    for bad in (0, True, "4", 2.0):
        with pytest.raises(ConfigError, match="keep_global_batch"):
            reference_world({"keep_global_batch": bad})


def test_policy_is_scaled_only_when_the_option_is_set_and_the_steps_are_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    policy = {"gradient_accumulation_steps": 2, "strategy": "ddp"}
    assert keep_global_batch(policy, {}, world_size=1, rank=0) == policy
    out = keep_global_batch(policy, {"keep_global_batch": 4}, world_size=2, rank=0)
    assert out == {"gradient_accumulation_steps": 4, "strategy": "ddp"}
    assert "gradient_accumulation_steps 2 -> 4" in capsys.readouterr().err
    keep_global_batch(policy, {"keep_global_batch": 4}, world_size=2, rank=1)
    assert capsys.readouterr().err == ""  # the main process says it, once
    same = keep_global_batch(policy, {"keep_global_batch": 4}, world_size=2, rank=0,
                             given=False)
    assert same["gradient_accumulation_steps"] == 2


def test_distributed_keyword_env_and_config_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with accel.distributed(gradient_accumulation_steps=3, keep_global_batch=2) as s:
        assert s.gradient_accumulation_steps == 6  # one process keeps the batch of two
        assert s.options["keep_global_batch"] == 2
        with accel.distributed(gradient_accumulation_steps=2) as inner:
            assert inner.gradient_accumulation_steps == 4  # its steps are for 2 processes too
        with accel.distributed(mixed_precision="no") as inner:
            assert inner.gradient_accumulation_steps == 6  # not scaled twice
    monkeypatch.setenv("ACCEL_KEEP_GLOBAL_BATCH", "4")
    with accel.distributed() as s:
        assert s.gradient_accumulation_steps == 4
    monkeypatch.delenv("ACCEL_KEEP_GLOBAL_BATCH")
    config = tmp_path / "config.toml"
    config.write_text("keep_global_batch = 2\ngradient_accumulation_steps = 2\n")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    with accel.distributed() as s:
        assert s.gradient_accumulation_steps == 4
    monkeypatch.delenv("ACCEL_CONFIG_FILE")
    with pytest.raises(ConfigError, match="keep_global_batch=0"), accel.distributed(
        keep_global_batch=0
    ):
        pass


def test_split_batches_is_refused_with_the_option() -> None:
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with fake_state(world_size=2, options={"keep_global_batch": 2}), pytest.raises(
        ConfigError, match="split_batches=True with keep_global_batch=2"
    ):
        accel.prepare_data_loader(loader, split_batches=True)


def _lr_after(world: int, steps: int, options: dict[str, int]) -> float:
    model = torch.nn.Linear(1, 1)
    with fake_state(world_size=world, options=options):
        opt = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        sched = accel.prepare_scheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
        for _ in range(steps):
            opt.step()
            sched.step()
        return float(sched.get_last_lr()[0])


def test_scheduler_steps_the_reference_world_per_optimizer_step() -> None:
    # without the option: Accelerate's rule, world_size scheduler steps per optimizer step
    assert _lr_after(2, 3, {}) == 0.5 ** 6
    assert _lr_after(1, 3, {}) == 0.5 ** 3
    # with it the schedule does not depend on the world the run restarted on
    assert _lr_after(1, 3, {"keep_global_batch": 2}) == _lr_after(2, 3, {}) == 0.5 ** 6


def _plan_env(*argv: str) -> dict[str, str]:
    ns = build_parser().parse_args(["launch", *argv])
    plan = plan_launch(ns, env=LaunchEnv(), file_settings={}, config_file=None,
                       gpu_count=lambda: 0, cpu_count=4, omp_num_threads_set=True)
    return dict(plan.worker_env)


def test_launch_flag_max_is_the_largest_world() -> None:
    elastic = ("--nnodes", "1:3", "--nproc-per-node", "2", "--rdzv-endpoint", "h:29400",
               "--max-restarts", "2")
    assert _plan_env(*elastic, "--keep-global-batch", "max", "t.py")[
        "ACCEL_KEEP_GLOBAL_BATCH"] == "6"
    assert _plan_env(*elastic, "--keep-global-batch", "4", "t.py")[
        "ACCEL_KEEP_GLOBAL_BATCH"] == "4"
    assert "ACCEL_KEEP_GLOBAL_BATCH" not in _plan_env(*elastic, "t.py")
    for bad in ("many", "0"):
        with pytest.raises(ConfigError, match=r"keep.global.batch"):
            _plan_env("--keep-global-batch", bad, "t.py")


def test_the_store_port_probe_binds_the_wildcard_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous import api

    from accel.launch.free_port import use_wildcard_free_port, wildcard_free_port

    assert 0 < wildcard_free_port() < 65536
    monkeypatch.setattr(api, "get_free_port", api.get_free_port)  # put back afterwards
    use_wildcard_free_port()
    assert api.get_free_port is wildcard_free_port
