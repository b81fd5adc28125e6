"""``accel test``: a distributed self-check run on every launched process.

Checks, in order: the collectives (reduce, gather, broadcast, objects, padding, barrier); a
few training steps of a tiny model with DDP, which must leave identical weights on every rank,
equal to one process training on the whole batch; a safetensors checkpoint round trip. Rank 0
prints one line per check (``accel test`` then prints PASS); any failure raises, so the launcher
reports the failing rank and its traceback and exits non-zero.

Run it with ``accel test`` (or ``accel launch path/to/selftest.py``).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import accel
from accel.errors import SelfTestError

__all__ = ["check_checkpoint", "check_collectives", "check_training", "main", "run_checks"]

_STEPS = 3
_GLOBAL_BATCH = 12


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise SelfTestError(f"accel test: {what} (rank {accel.state().rank})")


def check_collectives() -> str:
    """reduce, gather, broadcast, gather_object, broadcast_object, pad, barrier.

    Must be called on every rank, inside ``accel.distributed()``.

    Example:
        >>> check_collectives()
        'collectives on 2 processes (gloo, cpu)'
    """
    st = accel.state()
    rank, world = st.rank, st.world_size
    mine = torch.tensor([float(rank + 1)])
    total = accel.reduce(mine, "sum")
    _expect(float(total.item()) == world * (world + 1) / 2, f"reduce(sum) gave {total.item()}")
    gathered = accel.gather(mine)
    _expect(gathered.tolist() == [float(r + 1) for r in range(world)],
            f"gather gave {gathered.tolist()}")
    source = world - 1
    sent = accel.broadcast(torch.full((2,), float(rank)), from_process=source)
    _expect(sent.tolist() == [float(source)] * 2, f"broadcast gave {sent.tolist()}")
    objects = accel.gather_object({"rank": rank})
    _expect([o["rank"] for o in objects] == list(range(world)), f"gather_object gave {objects}")
    token = accel.broadcast_object(f"hello from {rank}" if rank == 0 else None)
    _expect(token == "hello from 0", f"broadcast_object gave {token!r}")
    padded = accel.pad_across_processes(torch.ones(rank + 1), dim=0, pad_index=-1)
    _expect(padded.shape[0] == world and float(padded.sum()) == rank + 1 - (world - rank - 1),
            f"pad_across_processes gave {padded.tolist()}")
    accel.wait_for_everyone()
    return f"collectives on {world} processes ({st.backend or 'single process'}, {st.device})"


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(_GLOBAL_BATCH, 6, generator=generator)
    targets = torch.randn(_GLOBAL_BATCH, 1, generator=generator)
    return inputs, targets


def _train(model: nn.Module, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(_STEPS):
        inputs, targets = batches(step)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()


def check_training() -> str:
    """DDP training on shards matches one process training on the whole batch.

    Must be called on every rank, inside ``accel.distributed()``.

    Example:
        >>> check_training()
        '3 DDP training steps agree across ranks and with one process'
    """
    st = accel.state()
    rank, world, device = st.rank, st.world_size, st.device
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    model = copy.deepcopy(reference).to(device)
    wrapped: nn.Module = model
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    inputs, targets = _data()
    per_rank = -(-_GLOBAL_BATCH // world)
    repeat = per_rank * world // _GLOBAL_BATCH + 1  # every rank gets an equal shard
    inputs, targets = inputs.repeat(repeat, 1)[: per_rank * world], targets.repeat(repeat, 1)[
        : per_rank * world]
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    _train(wrapped, lambda step: (inputs[shard].to(device), targets[shard].to(device)))
    _train(reference, lambda step: (inputs, targets))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = accel.broadcast(flat.clone(), from_process=0)
    _expect(torch.equal(flat, first), "weights differ across ranks after training")
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).to(device)
    tolerance = 1e-3 if device.type == "cuda" else 1e-5
    _expect(torch.allclose(flat, expected, atol=tolerance),
            f"DDP weights differ from single-process training by "
            f"{(flat - expected).abs().max().item():.3g}")
    return f"{_STEPS} DDP training steps agree across ranks and with one process"


def check_checkpoint() -> str:
    """A safetensors save/load round trip of a state dict is exact.

    Must be called on every rank, inside ``accel.distributed()``.

    Example:
        >>> check_checkpoint()
        'checkpoint round trip (safetensors)'
    """
    from safetensors.torch import load_file, save_file

    torch.manual_seed(accel.state().rank)
    model = nn.Linear(5, 3)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    with tempfile.TemporaryDirectory(prefix="accel-test-") as folder:
        path = Path(folder) / "model.safetensors"
        save_file(state, str(path))
        loaded = load_file(str(path))
    _expect(set(loaded) == set(state), f"checkpoint keys {sorted(loaded)} != {sorted(state)}")
    _expect(all(torch.equal(loaded[k], state[k]) for k in state), "checkpoint values changed")
    restored = nn.Linear(5, 3)
    restored.load_state_dict(loaded)
    _expect(torch.equal(restored.weight, model.weight), "load_state_dict changed the weights")
    accel.wait_for_everyone()
    return "checkpoint round trip (safetensors)"


def run_checks() -> list[str]:
    """Run every check inside ``accel.distributed()``; return their one-line descriptions.

    Must be called on every rank.

    Example:
        >>> for line in run_checks():
        ...     print("ok", line)
    """
    with accel.distributed(timeout=120):
        return [check() for check in (check_collectives, check_training, check_checkpoint)]


def main() -> None:
    """Entry point of the launched self-check; rank 0 prints the report.

    Example:
        >>> main()  # via `accel test`
    """
    results = run_checks()
    if accel.state().is_main_process:
        for line in results:
            print(f"  ok  {line}", flush=True)
        print(f"  all checks passed on {accel.state().world_size} process(es)", flush=True)


if __name__ == "__main__":
    main()
