"""The training paths on namespaced machines (accel.testing.machines): each machine with its
own address, hostname and local disk, the job started by `accel launch` on every machine or as
SLURM tasks (srun's variables). DDP (3 machines), FSDP2 (srun), HSDP (replicas across
machines, shards within), DeepSpeed ZeRO-2 and a pipeline stage per machine train equal to one
process on the same global batches; node-local and shared checkpoints load back on every
machine; the state and `accel env` name the real hosts and node ranks. Loopback does not exist
on the machines (the bed removes 127.0.0.1 and ::1), so a store or gloo socket on it would
fail the run; the sockets seen while DDP trains are between machine addresses only.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from accel.testing.machines import MachineRun, Machines, Socket, requires_machines
from tests import pipeline_models as pm
from tests.cli._helpers import clean_env
from tests.machines import train_script as ts

pytestmark = [pytest.mark.ci_extra, pytest.mark.slow, requires_machines()]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("train_script.py"))
TOLERANCE = 1e-6  # reduction order: one process sums the batch at once, the ranks in pieces
PY = sys.executable


def _env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path, PYTHONPATH=str(ROOT))


def _finished(bed: Machines, runs: list[MachineRun], timeout: float = 240) -> None:
    bed.wait(runs, timeout=timeout)
    failed = [r for r in runs if r.returncode != 0]
    assert not failed, "\n".join(f"--- {r.describe()} exited {r.returncode}:\n{r.output[-4000:]}"
                                 for r in failed)


def _results(out: Path, world: int) -> list[dict[str, Any]]:
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in found] == list(range(world))
    return found


def _largest_difference(got: dict[str, Any], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    return max(float((torch.tensor(got[k]) - v).abs().max()) for k, v in want.items())


def _assert_one_process(results: list[dict[str, Any]], losses: list[float],
                        weights: dict[str, torch.Tensor]) -> float:
    reached = 0.0
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=TOLERANCE)
        reached = max(reached, _largest_difference(result["weights"], weights))
    print(f"largest weight difference to one process: {reached:.1e}")
    assert reached <= TOLERANCE
    return reached


def _assert_placed(results: list[dict[str, Any]], per_machine: int, machines: int) -> None:
    placed = [[r, f"m{r // per_machine}", r // per_machine] for r in range(len(results))]
    for result in results:
        node = result["rank"] // per_machine
        assert (result["hostname"], result["state_hostname"]) == (f"m{node}", f"m{node}")
        assert (result["node_rank"], result["num_nodes"]) == (node, machines)
        assert result["local_rank"] == result["rank"] % per_machine
        assert f"node_rank={node}, num_nodes={machines}, hostname='m{node}'" in result["report"]
        assert result["hosts"] == placed  # every rank knows where every other one runs


def _watch_sockets(bed: Machines, runs: list[MachineRun]) -> set[Socket]:
    seen: set[Socket] = set()
    deadline = time.monotonic() + 240
    while any(r.returncode is None for r in runs) and time.monotonic() < deadline:
        for k in range(len(bed)):
            seen.update(bed.sockets(k))
        time.sleep(0.2)
    return seen


def test_ddp_on_three_machines_with_node_local_and_shared_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with Machines(3, shared=tmp_path) as bed:
        runs = bed.accel_launch([SCRIPT, "ddp", str(out), str(bed.disk_path)],
                                env=_env(tmp_path), cwd=tmp_path)
        sockets = _watch_sockets(bed, runs)
        _finished(bed, runs)
        results = _results(out, 3)
        # each machine wrote its own copy on its own disk (the host reads them all)
        disks = {k: sorted(p.name for p in (bed.disk(k) / "ckpt").iterdir()) for k in range(3)}
        files = {k: sorted(p.name for p in (bed.disk(k) / "ckpt" / "checkpoint_4").iterdir())
                 for k in range(3)}
        env_runs = bed.srun([PY, "-m", "accel.cli", "env"], env=_env(tmp_path), cwd=tmp_path)
        _finished(bed, env_runs, timeout=120)
        addresses = {bed.address(k) for k in range(3)}
    _assert_placed(results, 1, 3)
    losses, weights = ts.one_process(3 * ts.PER_RANK)
    _assert_one_process(results, losses, weights)
    assert {r["strategy"] for r in results} == {"ddp"} and {r["master"] for r in results} == {
        "m0"}
    for result in results:
        local, shared = result["checkpoints"]["local"], result["checkpoints"]["shared"]
        assert local["latest"] == f"{bed.disk_path}/ckpt/checkpoint_4"
        assert shared["latest"] == f"{out}/ckpt/checkpoint_4"
        for found in (local, shared):
            assert found["listing"] == ["checkpoint_2", "checkpoint_4"]
            assert (found["loaded_step"], found["same"]) == (4, True)
    assert disks == {k: ["checkpoint_2", "checkpoint_4"] for k in range(3)}
    common = ["manifest.json", "model.json", "model.safetensors", "optimizer.json",
              "optimizer.safetensors"]  # the whole state on each machine, its own ranks' rng
    assert files == {k: [*common, f"rng_rank{k}.json", f"rng_rank{k}.safetensors"]
                     for k in range(3)}
    for k, run in enumerate(env_runs):
        assert f"- host: m{k}\n" in run.stdout
        assert f"- launch: slurm: rank {k} of 3, node rank {k} of 3, local rank 0 of 1, " \
               "master m0:" in run.stdout
    # what bound and connected while training: the machines' addresses only
    connected = [s for s in sockets if s.state == "ESTABLISHED"]
    assert connected and not [s for s in sockets if s.loopback]
    assert {s.local[0] for s in connected} <= addresses
    assert any(s.remote == (bed.address(0), 29500) for s in connected)  # the store, on m0


def test_fsdp2_started_as_slurm_tasks_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with Machines(2, shared=tmp_path) as bed:
        runs = bed.srun([PY, SCRIPT, "fsdp", str(out)], env=_env(tmp_path), cwd=tmp_path)
        _finished(bed, runs)
    results = _results(out, 2)
    _assert_placed(results, 1, 2)
    assert {r["strategy"] for r in results} == {"fsdp"}
    _assert_one_process(results, *ts.one_process(2 * ts.PER_RANK))


def test_hsdp_replicates_across_machines_and_shards_within(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with Machines(2, shared=tmp_path) as bed:
        runs = bed.accel_launch([SCRIPT, "hsdp", str(out)], nproc_per_node=2,
                                env=_env(tmp_path), cwd=tmp_path)
        _finished(bed, runs)
    results = _results(out, 4)
    _assert_placed(results, 2, 2)
    for result in results:
        node = result["node_rank"]
        assert result["mesh"] == [1, 2, 2, 1, 1]
        assert result["shard_group"] == [2 * node, 2 * node + 1]  # within its machine
        assert result["replicate_group"] == [result["local_rank"], 2 + result["local_rank"]]
    _assert_one_process(results, *ts.one_process(4 * ts.PER_RANK))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="needs the deepspeed extra")
def test_deepspeed_zero2_on_two_machines_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with Machines(2, shared=tmp_path) as bed:
        runs = bed.accel_launch([SCRIPT, "deepspeed", str(out)], env=_env(tmp_path),
                                cwd=tmp_path)
        _finished(bed, runs)
    results = _results(out, 2)
    _assert_placed(results, 1, 2)
    assert {(r["strategy"], r["zero_stage"]) for r in results} == {("deepspeed", 2)}
    _assert_one_process(results, *ts.one_process(2 * ts.PER_RANK))


def test_a_pipeline_stage_per_machine_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with Machines(2, shared=tmp_path) as bed:
        runs = bed.accel_launch([SCRIPT, "pipeline", str(out)], env=_env(tmp_path),
                                cwd=tmp_path)
        _finished(bed, runs)
    results = _results(out, 2)
    _assert_placed(results, 1, 2)
    assert {tuple(r["mesh"]) for r in results} == {(2, 1, 1, 1, 1)}
    with accel.distributed():
        want = pm.train("stack")
    _assert_one_process(results, want["losses"], want["full"])
