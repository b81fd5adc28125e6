"""on_each_node on 2 and 3 real processes, with 2 machines faked.

Every rank gets a state saying which machine it is on (2 ranks: one per machine; 3 ranks:
ranks 0 and 1 on machine 0, rank 2 on machine 1), and passes its machine's own directory,
as a job on machines with local disks passes one path that names a different disk on each.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import accel
from accel.core.state import set_state
from accel.testing import run_distributed

NODES = {2: [(0, 0), (1, 0)], 3: [(0, 0), (0, 1), (1, 0)]}  # rank -> (node_rank, local_rank)


@contextmanager
def _machines() -> Iterator[accel.ProcessState]:
    st = accel.state()
    node, local = NODES[st.world_size][st.rank]
    local_world = sum(1 for n, _ in NODES[st.world_size] if n == node)
    faked = attrs.evolve(st, node_rank=node, local_rank=local, local_world_size=local_world,
                         num_nodes=2)
    with set_state(faked) as current:
        yield current


def _setup(seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = accel.prepare_model(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)))
    opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    return model, opt


def _step(model: nn.Module, opt: Any) -> None:
    x = torch.linspace(-1, 1, 24).reshape(4, 6) + accel.state().rank
    accel.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accel.get_state_dict(model).items()}


def _each_machine_its_copy(base: str) -> dict[str, Any]:
    with _machines() as st:
        here = Path(base) / f"machine{st.node_rank}"
        model, opt = _setup(0)
        _step(model, opt)
        accel.save_state(here / "ckpt", step=1, total_limit=1, model=model, optimizer=opt)
        _step(model, opt)
        random.seed(100 + st.rank)
        torch.manual_seed(200 + st.rank)
        path = accel.save_state(here / "ckpt", step=2, total_limit=1, model=model,
                                optimizer=opt)
        expected_rng = (random.random(), torch.rand(2).tolist())
        weights = _weights(model)
        accel.save(accel.unwrap_model(model).state_dict(), here / "model.pt")
        accel.save(accel.get_state_dict(model), here / "model.safetensors")
        accel.save_model(model, here / "export")
        model2, opt2 = _setup(1)
        info = accel.load_state(here / "ckpt", model=model2, optimizer=opt2)
        assert info is not None
        rng = (random.random(), torch.rand(2).tolist())
        same = all(torch.equal(v, accel.get_state_dict(model2)[k]) for k, v in weights.items())
        return {"path": str(path), "step": info.step, "rng_ok": rng == expected_rng,
                "weights_ok": same, "node": st.node_rank}


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_machine_writes_and_reads_its_own_copy(world_size: int, tmp_path: Path) -> None:
    results = run_distributed(_each_machine_its_copy, str(tmp_path), world_size=world_size,
                              on_each_node=True)  # the distributed() option sets the default
    assert all(r["step"] == 2 and r["rng_ok"] and r["weights_ok"] for r in results)
    ranks_of = {0: [r for r, (n, _) in enumerate(NODES[world_size]) if n == 0], 1: [world_size - 1]}
    bare = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    for node, ranks in ranks_of.items():
        here = tmp_path / f"machine{node}"
        assert sorted(p.name for p in (here / "ckpt").iterdir() if not p.name.startswith(".")) \
            == ["checkpoint_2"]  # rotated by each machine (total_limit=1)
        ckpt = here / "ckpt" / "checkpoint_2"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["ranks"] == ranks and manifest["world_size"] == world_size
        rng_files = sorted(p.name for p in ckpt.glob("rng_rank*.json"))
        assert rng_files == [f"rng_rank{r}.json" for r in ranks]  # its own ranks' RNG states
        assert {"model.safetensors", "optimizer.safetensors"} <= {p.name for p in ckpt.iterdir()}
        # every copy is complete and loadable on its own
        fresh = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
        with accel.distributed(), pytest.warns(UserWarning, match="RNG states are not restored"):
            info = accel.load_state(here / "ckpt", model=fresh)
        assert info is not None and info.step == 2
        accel.load_checkpoint_in_model(bare, here / "export", strict=True)
        assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in bare.state_dict().items())
        bare.load_state_dict(torch.load(here / "model.pt"))
        assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in bare.state_dict().items())
        assert set(accel.load(here / "model.safetensors")) == set(bare.state_dict())
    save_ids = {json.loads((tmp_path / f"machine{n}" / "ckpt" / "checkpoint_2" /
                            "manifest.json").read_text())["save_id"] for n in (0, 1)}
    assert len(save_ids) == 1  # both copies come from one save


def _one_copy_by_default(base: str) -> list[str]:
    with _machines() as st:
        here = Path(base) / f"machine{st.node_rank}"
        model, opt = _setup(0)
        _step(model, opt)
        shared = Path(base) / "shared"  # the same path on every machine: a shared filesystem
        path = accel.save_state(shared, step=1, model=model, optimizer=opt)
        model2, opt2 = _setup(1)
        info = accel.load_state(shared, model=model2, optimizer=opt2)
        assert info is not None and info.step == 1
        accel.save(accel.get_state_dict(model), here / "model.pt")
        accel.save_model(model, here / "export")
        return sorted(p.name for p in path.glob("rng_rank*.json"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_on_each_node_rank_0_writes_the_only_copy(
    world_size: int, tmp_path: Path
) -> None:
    results = run_distributed(_one_copy_by_default, str(tmp_path), world_size=world_size)
    assert results[0] == [f"rng_rank{r}.json" for r in range(world_size)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine0", "shared"]
    written = sorted(p.name for p in (tmp_path / "machine0").iterdir())
    assert [n for n in written if not n.endswith(".accel-lock")] == ["export", "model.pt"]


def _common_checkpoints_only(base: str) -> dict[str, Any]:
    with _machines() as st:
        here = Path(base) / f"machine{st.node_rank}"
        model, opt = _setup(0)
        for step in (1, 2):
            _step(model, opt)
            accel.save_state(here / "ckpt", step=step, model=model, optimizer=opt,
                             on_each_node=True)
        step1 = accel.save_state(here / "fixed", model=model, on_each_node=True)
        if st.node_rank == 1 and st.local_rank == 0:
            shutil.rmtree(here / "ckpt" / "checkpoint_2")  # this machine lost its newest one
            shutil.copytree(step1, here / "fixed_first")
        accel.wait_for_everyone()
        _step(model, opt)
        accel.save_state(here / "fixed", model=model, on_each_node=True)
        if st.node_rank == 1 and st.local_rank == 0:  # an older save's copy, on one machine
            shutil.rmtree(here / "fixed")
            shutil.copytree(here / "fixed_first", here / "fixed")
        accel.wait_for_everyone()
        model2, opt2 = _setup(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = accel.load_state(here / "ckpt", model=model2, optimizer=opt2,
                                    on_each_node=True)
        assert info is not None
        try:
            accel.load_state(here / "fixed", model=model2, on_each_node=True)
        except accel.CheckpointError as exc:
            mixed = str(exc)
        else:
            mixed = "no error"
        return {"step": info.step, "warnings": [str(w.message) for w in caught],
                "mixed": mixed}


def test_load_uses_only_checkpoints_every_machine_holds_from_one_save(tmp_path: Path) -> None:
    results = run_distributed(_common_checkpoints_only, str(tmp_path), world_size=3)
    for out in results:
        assert out["step"] == 1  # checkpoint_2 is on machine 0 only
        assert any("checkpoint_2 is on machines [0] only" in w for w in out["warnings"])
        assert "different saves" in out["mixed"]


def _shared_disk_with_on_each_node(base: str) -> str:
    with _machines():
        model, _ = _setup(0)
        try:
            accel.save_state(Path(base) / "ckpt", step=1, model=model, on_each_node=True)
        except accel.CheckpointError as exc:
            return str(exc)
        return "no error"


def test_on_each_node_on_a_shared_disk_fails_on_every_rank_with_a_hint(tmp_path: Path) -> None:
    results = run_distributed(_shared_disk_with_on_each_node, str(tmp_path), world_size=2)
    for message in results:
        assert "Another writer" in message and "on_each_node=False" in message
    ckpt = tmp_path / "ckpt"
    assert [p.name for p in ckpt.iterdir() if not p.name.endswith(".lock")] == []


def _ranks_moved_between_machines(base: str) -> dict[str, Any]:
    with _machines() as st:
        here = Path(base) / f"machine{st.node_rank}"
        model, _ = _setup(0)
        accel.save_state(here / "sync", model=model, on_each_node=True)
        with accel.accumulate(model):  # 1 of 2 micro-steps: per-rank gradients are state
            accel.backward(model(torch.ones(4, 6) * st.rank).pow(2).mean())
        accel.save_state(here / "mid", model=model, on_each_node=True)
        elsewhere = Path(base) / f"machine{1 - st.node_rank}"  # now on the other machine
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = accel.load_state(elsewhere / "sync", model=model, on_each_node=True)
        try:
            accel.load_state(elsewhere / "mid", model=model, on_each_node=True)
        except accel.CheckpointError as exc:
            mid = str(exc)
        else:
            mid = "no error"
        return {"loaded": info is not None, "warnings": [str(w.message) for w in caught],
                "mid": mid}


def test_ranks_on_other_machines_than_at_save_time(tmp_path: Path) -> None:
    results = run_distributed(_ranks_moved_between_machines, str(tmp_path), world_size=2,
                              gradient_accumulation_steps=2)
    for rank, out in enumerate(results):
        assert out["loaded"]  # the weights load; this rank's RNG states are elsewhere
        assert any(f"not of rank {rank}: its RNG states are not restored" in w
                   for w in out["warnings"])
        assert f"per-rank gradients of ranks [{1 - rank}], not of rank {rank}" in out["mid"]


def _no_local_main_on_a_machine(base: str) -> list[str]:
    st = accel.state()
    layout = attrs.evolve(st, node_rank=st.rank, local_rank=st.rank, num_nodes=2)
    messages = []
    with set_state(layout):  # machine 1's only process claims local_rank 1
        model, _ = _setup(0)
        for call in (
            lambda: accel.save_state(Path(base) / f"m{st.rank}", model=model, on_each_node=True),
            lambda: accel.load_state(Path(base) / f"m{st.rank}", model=model, on_each_node=True),
        ):
            try:
                call()
            except accel.CheckpointError as exc:
                messages.append(str(exc))
    return messages


def test_a_machine_without_a_local_main_process_is_an_error_on_every_rank(
    tmp_path: Path,
) -> None:
    results = run_distributed(_no_local_main_on_a_machine, str(tmp_path), world_size=2)
    for messages in results:
        assert len(messages) == 2
        assert all("node_rank=1 (ranks [1]) has 0 local main processes" in m for m in messages)
    assert not (tmp_path / "m0").exists() and not list(tmp_path.glob(".m0.tmp-*"))  # cleaned up
