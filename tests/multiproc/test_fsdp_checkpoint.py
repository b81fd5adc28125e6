"""FSDP2 checkpoints on real processes (gloo, CPU): sharded saves that reshard to any world size.

Every run trains on the same global batches (each rank takes its equal slice), so the FSDP runs
on 2 and 3 ranks, a DDP run and a plain single-process run compute the same steps: a checkpoint
saved on N ranks and loaded on M must continue exactly like the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import accel
from accel.errors import CheckpointArgumentError, CheckpointError
from accel.testing import run_distributed, run_script

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
FEATURES = 5
WIDTH = 31  # uneven shards on 2 and 3 ranks
STEPS = 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, 2)
        self.register_buffer("scale", torch.tensor([1.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.scale


def _net(seed: int = 0, width: int = WIDTH) -> Net:
    torch.manual_seed(seed)
    return Net(width)


def _batch(index: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    y = torch.randn(GLOBAL_BATCH, 2, generator=generator)
    per = GLOBAL_BATCH // world_size
    rows = slice(rank * per, (rank + 1) * per)
    return x[rows], y[rows]


def _step(model: nn.Module, optimizer: Any, index: int) -> None:
    st = accel.state()
    x, y = _batch(index, st.rank, st.world_size)
    accel.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def _prepared(strategy: str, seed: int = 0) -> tuple[nn.Module, Any]:
    model = accel.prepare_model(_net(seed), strategy=strategy)
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    return model, optimizer


def _shard_bytes(path: pathlib.Path) -> dict[int, int]:
    """Tensor bytes (file size less the header) of each rank's shard files, by rank."""
    manifest = json.loads((path / "manifest.json").read_text())
    out: dict[int, int] = {}
    for f in manifest["files"]:
        if "__shards_rank" in f["name"] and f["name"].endswith(".safetensors"):
            with open(path / f["name"], "rb") as file:
                header = int.from_bytes(file.read(8), "little")
            out[f["rank"]] = out.get(f["rank"], 0) + f["size"] - 8 - header
    return out


def _rows(rows: int, rank: int, world_size: int) -> int:
    """Rows of dim 0 that rank holds under FSDP2 (torch.chunk: ceil-sized chunks)."""
    size = -(-rows // world_size)
    return max(0, min(rows, (rank + 1) * size) - rank * size)


def _save_body(root: str, strategy: str) -> dict[str, Any]:
    """Train STEPS steps, save, take one more step; report states and file sizes."""
    from accel.weights import full as _full_weights

    model, optimizer = _prepared(strategy)
    for i in range(STEPS):
        _step(model, optimizer, i)
    trained = {k: v.clone() for k, v in accel.get_state_dict(model).items()}  # DDP: live views
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    path = accel.save_state(root, step=STEPS, model=model, optimizer=optimizer, scheduler=sched)
    # save_model gathers one shard file at a time: record what each gather holds.
    gathered: list[int] = []
    real = _full_weights.gather

    def recording(tensors: Any) -> dict[str, torch.Tensor]:
        out = real(tensors)
        gathered.append(sum(t.numel() * t.element_size() for t in out.values()))
        return out

    _full_weights.gather = recording  # type: ignore[assignment]
    try:
        accel.save_model(model, os.path.join(root, "weights"), max_shard_size="6KB")
    finally:
        _full_weights.gather = real  # type: ignore[assignment]
    _step(model, optimizer, STEPS)
    return {
        "trained": trained,
        "next": accel.get_state_dict(model),
        "path": str(path),
        "gathered": gathered,
        "devices": {t.device.type for t in trained.values()},
    }


def _load_body(root: str, strategy: str) -> dict[str, torch.Tensor]:
    """A fresh model and optimizer (other initial weights) load the checkpoint and step once."""
    model, optimizer = _prepared(strategy, seed=7)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    info = accel.load_state(root, model=model, optimizer=optimizer, scheduler=sched)
    assert info is not None and info.step == STEPS
    _step(model, optimizer, STEPS)
    return accel.get_state_dict(model)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> float:
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= atol, worst
    return worst


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[Any]]:
    root = tmp_path_factory.mktemp("fsdp2")
    return root, run_distributed(_save_body, str(root), "fsdp", world_size=2, timeout=120)


@pytest.mark.slow
def test_save_on_2_load_on_3_matches_the_uninterrupted_step(
    fsdp_saved: tuple[pathlib.Path, list[Any]],
) -> None:
    root, saved = fsdp_saved
    loaded = run_distributed(_load_body, str(root), "fsdp", world_size=3, timeout=120)
    for state in loaded:  # every rank gets the full weights back from get_state_dict
        _close(state, saved[0]["next"], atol=1e-6)


def test_save_on_2_load_into_a_plain_model_on_one_process(
    fsdp_saved: tuple[pathlib.Path, list[Any]],
) -> None:
    root, saved = fsdp_saved
    model = _net(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match="per-rank RNG states are not restored"):
        info = accel.load_state(root, model=model, optimizer=optimizer, scheduler=sched)
    assert info is not None and info.world_size == 2
    _close(accel.get_state_dict(model), saved[0]["trained"], atol=0.0)
    for param in model.parameters():  # the AdamW moments are whole tensors again
        assert optimizer.state[param]["exp_avg"].shape == param.shape
        assert float(optimizer.state[param]["step"]) == STEPS
    assert sched.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 0.05
    x, y = _batch(STEPS, 0, 1)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    _close(accel.get_state_dict(model), saved[0]["next"], atol=1e-6)


def test_each_rank_writes_about_one_nth_and_get_state_dict_is_full(
    fsdp_saved: tuple[pathlib.Path, list[Any]],
) -> None:
    _, saved = fsdp_saved
    path = pathlib.Path(saved[0]["path"])
    sizes = _shard_bytes(path)
    model = _net()
    total = sum(3 * p.numel() * 4 for p in model.parameters())  # weights, exp_avg, exp_avg_sq
    assert sorted(sizes) == [0, 1] and sum(sizes.values()) == total
    for rank, size in sizes.items():  # exactly this rank's rows of every tensor: ~1/2 each
        rows = sum(3 * _rows(p.shape[0], rank, 2) * p[0].numel() * 4 for p in model.parameters())
        assert size == rows
        assert 0.45 * total <= size <= 0.55 * total, (size, total)
    replicated = (path / "model.safetensors").stat().st_size  # the buffer only
    assert replicated < 200
    # get_state_dict: the same full CPU state dict on every rank, with the module's own keys
    assert saved[0]["devices"] == {"cpu"}
    assert set(saved[0]["trained"]) == set(model.state_dict())
    _close(saved[0]["trained"], saved[1]["trained"], atol=0.0)


def test_save_model_writes_full_weights_one_file_at_a_time(
    fsdp_saved: tuple[pathlib.Path, list[Any]],
) -> None:
    root, saved = fsdp_saved
    weights = root / "weights"
    index = json.loads((weights / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    assert len(saved[0]["gathered"]) == len(files) == len(saved[1]["gathered"])
    # no gather holds more than one file's worth (6 KB, or one tensor bigger than that)
    biggest = max(p.numel() * 4 for p in _net().parameters())
    assert max(saved[0]["gathered"]) <= max(6000, biggest)
    fresh = _net(seed=7)
    accel.load_checkpoint_in_model(fresh, weights, strict=True)
    _close(fresh.state_dict(), saved[0]["trained"], atol=0.0)
    for name in files:
        safetensors.torch.load_file(str(weights / name))  # plain safetensors files


def _ddp_then_fsdp_body(root: str) -> dict[str, Any]:
    ddp_root = os.path.join(root, "ddp")
    if accel.state().world_size == 2:
        return _save_body(ddp_root, "ddp")
    return {"next": _load_body(ddp_root, "fsdp")}


def test_ddp_checkpoint_loads_into_fsdp_and_fsdp_equals_ddp(
    fsdp_saved: tuple[pathlib.Path, list[Any]],
) -> None:
    root, fsdp = fsdp_saved
    ddp = run_distributed(_ddp_then_fsdp_body, str(root), world_size=2, timeout=120)
    # get_state_dict of FSDP-trained weights equals the DDP-trained model's on every rank
    for rank in range(2):
        _close(fsdp[rank]["trained"], ddp[0]["trained"], atol=1e-5)
    resumed = run_distributed(_ddp_then_fsdp_body, str(root), world_size=3, timeout=120)
    for state in resumed:
        _close(state["next"], ddp[0]["next"], atol=1e-6)


def _errors_body(root: str) -> dict[str, str]:
    """Corruption, rotation, async saves and refusals on 2 ranks."""
    out: dict[str, str] = {}
    model, optimizer = _prepared("fsdp")
    _step(model, optimizer, 0)
    for step in range(1, 5):  # rotation keeps the newest two; async saves write in background
        accel.save_state(root, step=step, total_limit=2, async_save=step % 2 == 0,
                         model=model, optimizer=optimizer)
    accel.wait_for_checkpoints()
    out["kept"] = ",".join(sorted(p.name for p in pathlib.Path(root).glob("checkpoint_*")))
    fresh, fresh_opt = _prepared("fsdp", seed=3)
    info = accel.load_state(root, model=fresh, optimizer=fresh_opt)
    out["latest"] = str(info.step if info else None)
    out["equal"] = str(all(
        torch.equal(a, b) for a, b in zip(accel.get_state_dict(fresh).values(),
                                          accel.get_state_dict(model).values(), strict=True)
    ))
    accel.wait_for_everyone()
    # a flipped byte in rank 1's shard file is caught (on every rank) by the manifest's CRC32
    victim = pathlib.Path(root, "checkpoint_4", "model__shards_rank1.safetensors")
    if accel.state().is_main_process:
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x10
        victim.write_bytes(bytes(data))
    accel.wait_for_everyone()
    try:
        accel.load_state(os.path.join(root, "checkpoint_4"), model=fresh, optimizer=fresh_opt)
    except CheckpointError as exc:
        out["corrupt"] = str(exc)
    # an FSDP optimizer saved without its model is kept by positions (and resharded)
    accel.save_state(os.path.join(root, "alone"), optimizer=optimizer)
    accel.load_state(os.path.join(root, "alone"), optimizer=fresh_opt)
    out["alone"] = str(all(
        torch.equal(optimizer.state[p]["exp_avg"].to_local(),
                    fresh_opt.state[q]["exp_avg"].to_local())
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    ))
    try:
        accel.save_state(os.path.join(root, "each"), on_each_node=True, model=model)
    except CheckpointArgumentError as exc:
        out["each"] = str(exc)
    try:
        accel.load_state(os.path.join(root, "checkpoint_3"), optimizer=fresh_opt)
    except CheckpointError as exc:
        out["load_no_model"] = str(exc)
    wider = accel.prepare_model(_net(width=WIDTH + 1), strategy="fsdp")
    try:
        accel.load_state(os.path.join(root, "checkpoint_3"), model=wider)
    except CheckpointError as exc:
        out["shape"] = str(exc)
    with accel.distributed(gradient_accumulation_steps=2):
        with accel.accumulate(model):
            _step(model, optimizer, 1)
        try:
            accel.save_state(os.path.join(root, "mid"), model=model)
        except CheckpointError as exc:
            out["mid_cycle"] = str(exc)
    return out


def test_fsdp_checkpoints_rotate_verify_and_refuse_clearly(tmp_path: pathlib.Path) -> None:
    results = run_distributed(_errors_body, str(tmp_path), world_size=2, timeout=120)
    for out in results:
        assert out["kept"] == "checkpoint_3,checkpoint_4"
        assert out["latest"] == "4" and out["equal"] == "True"
        assert "CRC32" in out["corrupt"] and "model__shards_rank1.safetensors" in out["corrupt"]
        assert out["alone"] == "True"
        assert "on_each_node=True" in out["each"] and "'model'" in out["each"]
        assert "pass the model too" in out["load_no_model"]
        assert "shape" in out["shape"] and "another model" in out["shape"]
        assert "accumulation cycle" in out["mid_cycle"] and "sync step" in out["mid_cycle"]
    assert not (tmp_path / "mid").exists()


RESUME_SCRIPT = '''
import os, signal, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import accel

root, total, die_at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with accel.distributed(seed=1234, strategy="fsdp"):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(44, 6, generator=g), torch.randn(44, 1, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 17), nn.Dropout(0.3), nn.ReLU(), nn.Linear(17, 1))
    model = accel.prepare_model(model)
    opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    sched = accel.prepare_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7))
    loader = accel.prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True))
    objects = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    info = accel.load_state(root, missing_ok=True, **objects)
    step = info.step if info and info.step is not None else 0
    while step < total:
        for x, y in loader:
            accel.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step % 3 == 0:
                accel.save_state(root, step=step, total_limit=2, **objects)
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= total:
                break
    weights = accel.get_state_dict(model)
    if accel.state().is_main_process:
        accel.save(weights, out)
'''


def _resume_run(script: pathlib.Path, root: pathlib.Path, die_at: int, out: pathlib.Path) -> bool:
    """The script on 2 launched processes, forked from warm workers; whether both exited 0
    (required when it is not to die)."""
    done = run_script(script, str(root), "14", str(die_at), str(out), world_size=2,
                      env={"OMP_NUM_THREADS": "1"}, check=die_at == 0)
    return done.ok


@pytest.mark.slow
@pytest.mark.ci_extra
def test_fsdp_killed_and_resumed_run_is_bit_exact(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "fsdp_resume.py"
    script.write_text(RESUME_SCRIPT)
    _resume_run(script, tmp_path / "straight", 0, tmp_path / "straight.safetensors")
    ok = _resume_run(script, tmp_path / "resumed", 8, tmp_path / "unused.safetensors")
    assert not ok  # it really died, after its step-6 checkpoint
    assert not (tmp_path / "unused.safetensors").exists()
    _resume_run(script, tmp_path / "resumed", 0, tmp_path / "resumed.safetensors")
    straight = safetensors.torch.load_file(str(tmp_path / "straight.safetensors"))
    resumed = safetensors.torch.load_file(str(tmp_path / "resumed.safetensors"))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
