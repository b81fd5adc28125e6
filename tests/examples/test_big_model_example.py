"""examples/big_model_inference.py on 2 CPU processes and on one; bench/big_model.py smoke run."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
from types import ModuleType

import pytest
import torch

from accel.testing import ScriptResult, run_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "big_model_inference.py"
BENCH = ROOT / "bench" / "big_model.py"


def _run(script: pathlib.Path, *args: str, cwd: pathlib.Path, world_size: int) -> ScriptResult:
    """``accel launch --nproc-per-node 2 --cpu SCRIPT ARGS`` (world_size 2) or ``python SCRIPT
    ARGS`` (world_size 1), forked from warm workers by ``run_script`` (raises on a failure)."""
    return run_script(script, *args, world_size=world_size, cwd=cwd, launch=world_size > 1,
                      env={"OMP_NUM_THREADS": "1"})


def _example_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("big_model_inference_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device_map(stdout: str) -> dict[str, str]:
    """The hf_device_map the example printed for its offloaded run."""
    line = next(line for line in stdout.splitlines() if "flow 2 with max_memory" in line)
    value = ast.literal_eval(line.split("hf_device_map ", 1)[1])
    assert isinstance(value, dict)
    return value


def _check_run(done: ScriptResult, out: pathlib.Path, world: int) -> None:
    assert done.exit_codes == (0,) * world
    stdout = done.output
    assert "loads with torch.load; outputs equal" in stdout
    assert "flow 2 in RAM: hf_device_map" in stdout
    assert f"match the fully loaded model on {world} process(es)" in stdout
    # part of the model ran from disk, part from RAM, and blocks were never split
    device_map = _device_map(stdout)
    assert "disk" in device_map.values() and "cpu" in device_map.values(), device_map
    assert not any(name.count(".") > 1 for name in device_map), device_map
    for rank in range(world):
        assert (out / f"offload-rank{rank}").is_dir()
    # the saved file is torch's format: plain torch.load (weights_only=True) reads it
    example = _example_module()
    model = example.CriticModel()
    state = torch.load(out / "critic")
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state)


def test_big_model_example_on_two_cpu_processes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    done = _run(EXAMPLE, "--output-dir", str(out), cwd=tmp_path, world_size=2)
    _check_run(done, out, world=2)


def test_big_model_example_as_plain_python(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    done = _run(EXAMPLE, "--output-dir", str(out), cwd=tmp_path, world_size=1)
    _check_run(done, out, world=1)
    assert not (out / "offload-rank1").exists()


@pytest.mark.ci_extra
@pytest.mark.slow
def test_big_model_bench_smoke_run_accel_only(tmp_path: pathlib.Path) -> None:
    # cases (b) torch file and (c) disk offload: one fresh child each (~3 s apiece)
    done = _run(BENCH, "--layers", "2", "--size", "256", "--repeats", "1", "--cases", "bc",
                "--no-accelerate", "--dir", str(tmp_path), cwd=tmp_path, world_size=1)
    report = json.loads(done.output)
    assert report["accelerate"] is None and set(report["results"]) == {"accel"}
    results = report["results"]["accel"]
    assert set(results) == {"b", "c"}
    for case, result in results.items():
        assert "error" not in result, (case, result)
        assert result["max_abs_diff"] <= 1e-6, (case, result)
        assert result["peak_rss_mb"] > 0 and result["load_s"] > 0
    assert "disk" in results["c"]["placement"], results["c"]
    assert results["b"]["placement"] == {"cpu": 1}, results["b"]
    assert report["files"]["shard_count"] == 2  # 2 layers, at most 4 shards, one per layer
    assert report["goals"]["correct"]["result"] == "PASS"
    assert report["goals"]["a"]["result"] == "n/a"  # needs accelerate
    assert list(tmp_path.iterdir()) == []  # the bench removed its files
