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
