"""A call every rank must make, entered by only some ranks, is named within ``arrival_timeout``.

Diffusers' ``if accelerator.is_main_process: accelerator.save_state(...)`` ported literally
leaves rank 0 in ``save_state`` and rank 1 in the next backward's all-reduce: without the
arrival check nothing is reported until the 30-minute collective timeout. Every run here is
bounded far below that (``run_distributed(timeout=...)``), so a regression fails instead of
hanging; the bound the test sets is ``arrival_timeout=1`` or ``2`` seconds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import accel
from accel.errors import ArrivalTimeoutError, CollectiveMismatchError, GatedCollectiveError
from accel.testing import run_distributed


def _step(model: nn.Module, opt: Any) -> None:
    accel.backward(model(torch.ones(4, 4)).pow(2).mean())  # DDP: an all-reduce in backward
    opt.step()
    opt.zero_grad()


def _prepared() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[no-any-return]


def _gated_save(root: str) -> None:
    """Diffusers' shape: the save inside ``if is_main_process:``, then the next step."""
    model, opt = _prepared()
    _step(model, opt)
    if accel.state().is_main_process:
        accel.save_state(root, model=model, optimizer=opt)
    _step(model, opt)  # rank 1 blocks in this backward's all-reduce, which rank 0 never joins


@pytest.mark.ci_extra  # waits out a 2 s bound, then the peer's end: ~12 s
def test_a_save_state_inside_if_is_main_process_is_named_and_the_run_ends(
    tmp_path: Path,
) -> None:
    # today: rank 0 waits in save_state's first collective, rank 1 in the all-reduce, and the
    # run only ends when run_distributed kills it at its timeout
    with pytest.raises(ArrivalTimeoutError) as info:
        run_distributed(_gated_save, str(tmp_path / "ckpt"), world_size=2, timeout=45,
                        arrival_timeout=2)
    message = str(info.value)
    assert "accel.save_state()" in message
    assert "ranks [1] never arrived" in message and "ranks [0] did" in message
    assert "arrival_timeout=2.0" in message
    assert "if accel.is_main_process:" in message  # the usual cause
    assert "`accel.save_state(directory, ...)`" in message  # the fix
    assert "Traceback from rank 0 of 2" in str(info.value.__cause__)
    assert not (tmp_path / "ckpt").exists()  # nothing was written


def _mixed_calls(root: str) -> dict[str, Any]:
    """The normal path, then the calls two ranks make differently, in one process group."""
    st = accel.state()
    store = dist.distributed_c10d._get_default_store()
    model = nn.Linear(2, 2)
    out: dict[str, Any] = {}
    # normal path: every rank makes the same calls; rounds leave no keys piling up
    accel.save_state(root, step=1, model=model)
    info = accel.load_state(root, model=model)
    out["loaded_step"] = None if info is None else info.step
    for _ in range(3):
        accel.wait_for_everyone()
    # every call but the last has had its keys deleted: none pile up
    calls = int(store.add(f"accel/arrive/count/{st.rank}", 0))
    accel.wait_for_everyone()  # call number `calls`: it deletes the keys of the one before
    dist.barrier()  # (unchecked) every rank has finished its deletions
    keys = ["total", "done", *(f"rank/{rank}" for rank in range(st.world_size))]
    out["left"] = [
        n for n in range(calls + 1)
        if any(store.check([f"accel/arrive/{n}/{key}"]) for key in keys)
    ]
    out["calls"] = calls
    # a slow rank is no error where waiting is the call's purpose (longer than the bound)
    if st.rank == 0:
        time.sleep(2.5)
    accel.wait_for_everyone()
    # rank 0 saves while rank 1 loads: both named, on both ranks
    try:
        if st.rank == 0:
            accel.save_state(root, step=2, model=model)
        else:
            accel.load_state(root, model=model)
        out["mismatch"] = "no error"
    except CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    # accel's own gate still wins: raised at once, before any waiting
    @accel.on_main_process
    def save() -> None:
        accel.save_state(root, step=3, model=model)

    try:
        save()
        out["gated"] = "no error"
    except GatedCollectiveError as exc:
        out["gated"] = f"GatedCollectiveError: {exc}"
    accel.wait_for_everyone()  # still in step after both errors
    out["done"] = True
    return out


def test_mismatched_calls_are_named_on_every_rank_and_the_normal_path_is_unchanged(
    tmp_path: Path,
) -> None:
    results = run_distributed(_mixed_calls, str(tmp_path / "ckpt"), world_size=2, timeout=60,
                              arrival_timeout=1)
    for rank, out in enumerate(results):
        assert out["loaded_step"] == 1 and out["done"] is True, (rank, out)
        # distributed()'s settings agreement, save, load, 3 waits; the last call's keys only
        assert out["calls"] == 6 and out["left"] == [6], (rank, out)
        mismatch = out["mismatch"]
        assert "rank 0: accel.save_state()" in mismatch, (rank, mismatch)
        assert "rank 1: accel.load_state()" in mismatch, (rank, mismatch)
        assert "if accel.is_main_process:" in mismatch, (rank, mismatch)
    assert results[0]["gated"].startswith("GatedCollectiveError: accel.save_state()")
    assert results[1]["gated"] == "no error"  # the gate skipped the function on rank 1
    assert not (tmp_path / "ckpt" / "checkpoint_2").exists()
    assert not (tmp_path / "ckpt" / "checkpoint_3").exists()


def _wait_alone() -> None:
    with accel.distributed(timeout=2):  # wait_for_everyone's bound is the collective timeout
        if accel.state().rank == 0:
            accel.wait_for_everyone()  # rank 1 goes on to a collective rank 0 never joins
        accel.gather(torch.ones(1))


def test_a_rank_missing_at_wait_for_everyone_is_named_within_the_collective_timeout() -> None:
    with pytest.raises(ArrivalTimeoutError, match=r"accel\.wait_for_everyone\(\)") as info:
        run_distributed(_wait_alone, world_size=2, timeout=45, arrival_timeout=1)
    assert "ranks [1] never arrived" in str(info.value)
    assert "timeout=2.0" in str(info.value)


def _prepare_on_rank_0_only() -> str:
    if accel.state().rank == 0:  # `if is_main_process:` around a call every rank must make
        try:
            accel.prepare_model(nn.Linear(2, 2))
        except CollectiveMismatchError as error:
            return str(error)
        return "no error"
    try:
        accel.wait_for_everyone()  # rank 1 went on to the next call every rank must make
    except CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_a_prepare_model_on_one_rank_only_is_named_instead_of_hanging_in_the_agreement() -> None:
    # the ranks' settings agreement in prepare_model is a collective: rank 0 alone in it
    # would wait until the collective timeout; its arrival check names both calls at once
    results = run_distributed(_prepare_on_rank_0_only, world_size=2, timeout=45,
                              arrival_timeout=30)
    for message in results:
        assert "rank 0: accel.prepare_model()" in message, message
        assert "rank 1: accel.wait_for_everyone()" in message, message
