from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import accel
from accel.profiling import trace_path
from accel.testing import fake_state


@pytest.fixture(autouse=True)
def _inductor_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.profiler sets TORCHINDUCTOR_CACHE_DIR on first use; keep the environment clean.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def _work() -> torch.Tensor:
    a = torch.randn(32, 32)
    return (a @ a).sum()


def test_profile_yields_the_profiler_and_writes_a_trace_per_rank(tmp_path: Path) -> None:
    with accel.profile(output_trace_dir=tmp_path / "traces", record_shapes=True) as prof:
        _work()
    assert isinstance(prof, torch.profiler.profile)
    assert any(e.key == "aten::mm" for e in prof.key_averages())
    trace = json.loads(trace_path(tmp_path / "traces", 0).read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    with fake_state(rank=1, world_size=2), accel.profile(output_trace_dir=tmp_path / "traces"):
        _work()
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "profile_0.json",
        "profile_1.json",
    ]


def test_profile_without_directory_writes_nothing(tmp_path: Path) -> None:
    before = set(tmp_path.iterdir())
    with accel.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _work()
    assert prof.key_averages()
    assert set(tmp_path.iterdir()) == before


@pytest.mark.filterwarnings("ignore:.*clears events at the end of each cycle")
def test_profile_with_schedule_writes_each_cycle(tmp_path: Path) -> None:
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=2)
    with accel.profile(output_trace_dir=tmp_path / "t", schedule=schedule) as prof:
        for _ in range(6):
            _work()
            prof.step()
    names = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert names == ["profile_0_step3.json", "profile_0_step6.json"]


# --- Accelerate's ProfileKwargs forms: string activities and schedule_option -------------


def _cpu_ops(prof: torch.profiler.profile) -> set[str]:
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("activities", [["cpu"], ["CPU"], [" Cpu "], "cpu"])
def test_string_activities_profile_cpu_events(activities: object) -> None:
    with accel.profile(activities=activities) as prof:
        _work()
    assert "aten::mm" in _cpu_ops(prof)


def test_string_and_enum_activities_mix_and_deduplicate() -> None:
    with accel.profile(activities=["cpu", torch.profiler.ProfilerActivity.CPU]) as prof:
        _work()
    assert prof.activities == {torch.profiler.ProfilerActivity.CPU}
    assert "aten::mm" in _cpu_ops(prof)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_without_cuda_warns_and_is_dropped() -> None:
    with (
        pytest.warns(UserWarning, match=r"\['cuda'\].*not available.*dropped"),
        accel.profile(activities=["cpu", "cuda"]) as prof,
    ):
        _work()
    assert prof.activities == {torch.profiler.ProfilerActivity.CPU}
    assert "aten::mm" in _cpu_ops(prof)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_only_unavailable_activities_fall_back_to_cpu() -> None:
    with (
        pytest.warns(UserWarning, match="profiling CPU only"),
        accel.profile(activities=["CUDA"]) as prof,
    ):
        _work()
    assert prof.activities == {torch.profiler.ProfilerActivity.CPU}
    assert "aten::mm" in _cpu_ops(prof)


def test_unknown_activity_name_is_a_config_error() -> None:
    with (
        pytest.raises(accel.ConfigError, match=r"'gpu'.*\['cpu', 'cuda', 'xpu', 'mtia', 'hpu'\]"),
        accel.profile(activities=["cpu", "gpu"]),
    ):
        pass


@pytest.mark.parametrize(("activities", "message"), [([3], "items must be.*got 3"), (5, "got 5")])
def test_activity_of_wrong_type_is_a_config_error(activities: object, message: str) -> None:
    with (
        pytest.raises(accel.ConfigError, match=message),
        accel.profile(activities=activities),
    ):
        pass


def _run_steps(steps: int, **options: object) -> list[int]:
    """Step a profiled loop; return the step numbers at which on_trace_ready fired."""
    fired: list[int] = []
    with accel.profile(on_trace_ready=lambda p: fired.append(p.step_num), **options) as prof:
        for _ in range(steps):
            _work()
            prof.step()
    return fired


@pytest.mark.parametrize(
    "option",
    [
        {"wait": 1, "warmup": 1, "active": 2, "repeat": 2},
        {"wait": 0, "warmup": 1, "active": 1, "repeat": 0, "skip_first": 2},
    ],
)
def test_schedule_option_steps_like_the_equivalent_torch_schedule(
    option: dict[str, int],
) -> None:
    from_dict = _run_steps(10, activities=["cpu"], schedule_option=option)
    from_torch = _run_steps(10, activities=["cpu"], schedule=torch.profiler.schedule(**option))
    assert from_dict == from_torch
    assert len(from_dict) >= 2


def test_schedule_option_records_only_the_active_steps() -> None:
    option = {"wait": 1, "warmup": 1, "active": 1, "repeat": 1}
    with accel.profile(activities=["cpu"], schedule_option=option, on_trace_ready=None) as prof:
        for i in range(5):
            with torch.profiler.record_function(f"iteration_{i}"):
                _work()
            prof.step()
    recorded = {key for key in _cpu_ops(prof) if key.startswith("iteration_")}
    assert recorded == {"iteration_2"}


@pytest.mark.filterwarnings("ignore:.*clears events at the end of each cycle")
def test_schedule_option_writes_each_cycle_trace(tmp_path: Path) -> None:
    option = {"wait": 1, "warmup": 1, "active": 1, "repeat": 2}
    with accel.profile(output_trace_dir=tmp_path, schedule_option=option) as prof:
        for _ in range(6):
            _work()
            prof.step()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["profile_0_step3.json", "profile_0_step6.json"]


def test_schedule_option_unknown_keys_are_named() -> None:
    with (
        pytest.raises(accel.ConfigError, match=r"\['cycles', 'pause'\].*allowed keys"),
        accel.profile(
            schedule_option={"wait": 1, "warmup": 1, "active": 1, "pause": 1, "cycles": 2}
        ),
    ):
        pass


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"wait": 1, "warmup": 1}, r"missing \['active'\]"),
        ({"wait": 1, "warmup": 1, "active": 0}, "active > 0"),
        ({"wait": -1, "warmup": 1, "active": 1}, "wait=-1"),
        ({"wait": 1, "warmup": 1, "active": "2"}, r"schedule_option\['active'\] must be an int"),
        ({"wait": 1, "warmup": 1, "active": True}, "must be an int, got True"),
        ([("wait", 1)], "must be a dict"),
    ],
)
def test_bad_schedule_option_is_a_config_error(option: object, message: str) -> None:
    with (
        pytest.raises(accel.ConfigError, match=message),
        accel.profile(schedule_option=option),  # type: ignore[arg-type]
    ):
        pass


def test_schedule_and_schedule_option_together_is_a_config_error() -> None:
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1)
    with (
        pytest.raises(accel.ConfigError, match="pass only one"),
        accel.profile(schedule=schedule, schedule_option={"wait": 0, "warmup": 1, "active": 1}),
    ):
        pass
