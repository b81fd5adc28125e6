"""One training run on namespaced machines (tests/machines), started on every machine by
``accel launch`` (or as SLURM tasks): ``python train_script.py MODE OUT [DISK]``.

Each rank writes ``OUT/rank<r>.json``: where it ran (hostname, node rank, the state's report),
each step's loss, the full weights after the steps, and for the data-parallel modes what a
node-local and a shared ``save_state`` gave (``latest_checkpoint`` and ``load_state`` on this
machine). The test compares with one process on the same global batches.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel

STEPS, PER_RANK, LR = 4, 4, 0.01


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def data(global_batch: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    rows = STEPS * global_batch
    return TensorDataset(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))


def one_process(global_batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one plain torch process, ``global_batch`` rows a step."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in DataLoader(data(global_batch), batch_size=global_batch):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _weights(model: Any) -> dict[str, list[Any]]:
    return {k: v.tolist() for k, v in accel.get_state_dict(model).items()}


def _checkpoints(model: Any, optimizer: Any, disk: str, shared: str) -> dict[str, Any]:
    """Save on this machine's disk (each machine its copy) and in the shared folder; then
    what this machine finds and loads back."""
    trained = accel.get_state_dict(model)
    out: dict[str, Any] = {}
    for where, root, each in (("local", f"{disk}/ckpt", True), ("shared", f"{shared}/ckpt", False)):
        for step in (2, 4):
            accel.save_state(root, step=step, total_limit=2, on_each_node=each,
                             model=model, optimizer=optimizer)
        latest = accel.latest_checkpoint(root)
        fresh = accel.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(),
                                                  nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)))
        fresh_opt = accel.prepare_optimizer(torch.optim.AdamW(fresh.parameters(), lr=LR))
        info = accel.load_state(root, model=fresh, optimizer=fresh_opt, on_each_node=each)
        loaded = accel.get_state_dict(fresh)
        out[where] = {
            "latest": str(latest),
            "listing": sorted(p.name for p in Path(root).iterdir()),
            "loaded_step": getattr(info, "step", None),
            "same": all(torch.equal(loaded[k], v) for k, v in trained.items()),
        }
    return out


def data_parallel(mode: str, disk: str | None, shared: str) -> dict[str, Any]:
    st = accel.state()
    loader = DataLoader(data(PER_RANK * st.dp_world_size), batch_size=PER_RANK)
    base = net()
    model, optimizer, loader = accel.prepare(base, torch.optim.AdamW(base.parameters(), lr=LR),
                                             loader)
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accel.reduce(loss.detach(), "mean")))
    out: dict[str, Any] = {"losses": losses, "weights": _weights(model)}
    if st.mesh is not None and "dp_shard" in (st.mesh.mesh_dim_names or ()):
        out["shard_group"] = st.mesh["dp_shard"].mesh.flatten().tolist()
        out["replicate_group"] = st.mesh["dp_replicate"].mesh.flatten().tolist()
    if mode == "deepspeed":
        out["zero_stage"] = model.zero_optimization_stage()
    if disk is not None:
        out["checkpoints"] = _checkpoints(model, optimizer, disk, shared)
    return out


def pipeline() -> dict[str, Any]:
    from tests import pipeline_models as pm

    done = pm.train_with("1F1B")
    return {"losses": done["losses"], "weights": {k: v.tolist() for k, v in done["full"].items()}}


MODES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fsdp": {"strategy": "fsdp"},
    "hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "deepspeed": {"strategy": "deepspeed", "zero_stage": 2},
    "pipeline": {"pp_size": 2},
}


def main() -> None:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    disk = sys.argv[3] if len(sys.argv) > 3 else None
    with accel.distributed(**MODES[mode]) as st:
        result = pipeline() if mode == "pipeline" else data_parallel(mode, disk, str(out_dir))
        result.update({
            "hostname": socket.gethostname(), "state_hostname": getattr(st, "hostname", None),
            "report": repr(st), "rank": st.rank, "local_rank": st.local_rank,
            "node_rank": st.node_rank, "num_nodes": st.num_nodes, "world": st.world_size,
            "strategy": st.strategy, "mesh": st.mesh_shape,
            "master": os.environ.get("MASTER_ADDR"),
            "hosts": accel.gather_object((st.rank, socket.gethostname(), st.node_rank)),
        })
    (out_dir / f"rank{st.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
