"""Every collective on 2 and 3 real processes over gloo."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import accel
from accel.testing import run_distributed


def _collectives_body() -> dict[str, Any]:
    st = accel.state()
    r, n = st.rank, st.world_size
    out: dict[str, Any] = {
        "backend": st.backend, "device": str(st.device), "use": st.use_distributed
    }
    nested = {"a": torch.tensor([r, r]), "b": [torch.tensor(float(r))]}
    gathered = accel.gather(nested)
    out["gather_a"] = gathered["a"].tolist()
    out["gather_scalar"] = gathered["b"][0].tolist()
    out["gather_object"] = accel.gather_object({"rank": r})
    weight = torch.ones(2, requires_grad=True)
    out["gather_grad"] = accel.gather(weight * r).tolist()  # an output of the forward pass
    source = torch.tensor([float(r + 1)])
    out["sum"] = accel.reduce(source).item()
    out["mean"] = accel.reduce(source, "mean").item()
    out["max"] = accel.reduce(source, "max").item()
    out["min"] = accel.reduce({"x": source}, "min", scale=10.0)["x"].item()
    out["source_after_reduce"] = source.item()
    mine = torch.tensor([r, 10 + r])
    got = accel.broadcast(mine, from_process=n - 1)
    out["broadcast"] = got.tolist()
    out["broadcast_is_new"] = got is not mine and mine.tolist() == [r, 10 + r]
    out["broadcast_object"] = accel.broadcast_object({"from": r}, from_process=1)
    ragged = torch.full((r + 1, 2), r + 1)
    out["pad"] = accel.pad_across_processes(ragged, pad_index=-1).tolist()
    out["pad_first"] = accel.pad_across_processes(ragged, dim=0, pad_first=True).tolist()
    out["pad_dim1"] = accel.pad_across_processes(torch.ones(1, r + 1), dim=1).tolist()
    items = list(range(7))
    with accel.split_between_processes(items) as share:
        out["split"] = share
    with accel.split_between_processes(items, apply_padding=True) as share:
        out["split_padded"] = share
        out["split_padded_gathered"] = accel.gather(torch.tensor(share)).tolist()
    if r == n - 1:
        accel.set_trigger()
    out["trigger"] = [accel.check_trigger(), accel.check_trigger()]
    accel.wait_for_everyone()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective(world_size: int) -> None:
    results = run_distributed(_collectives_body, world_size=world_size)
    n = world_size
    for r, out in enumerate(results):
        assert out["backend"] == "gloo" and out["device"] == "cpu" and out["use"]
        assert out["gather_a"] == [x for k in range(n) for x in (k, k)]
        assert out["gather_scalar"] == [float(k) for k in range(n)]
        assert out["gather_object"] == [{"rank": k} for k in range(n)]
        assert out["gather_grad"] == [float(k) for k in range(n) for _ in range(2)]
        assert out["sum"] == n * (n + 1) / 2
        assert out["mean"] == (n + 1) / 2
        assert (out["max"], out["min"]) == (n, 10.0)
        assert out["source_after_reduce"] == r + 1  # input unchanged
        assert out["broadcast"] == [n - 1, 10 + n - 1] and out["broadcast_is_new"]
        assert out["broadcast_object"] == {"from": 1}
        expected_pad = [[r + 1] * 2] * (r + 1) + [[-1, -1]] * (n - 1 - r)
        assert out["pad"] == expected_pad
        assert out["pad_first"] == [[0, 0]] * (n - 1 - r) + [[r + 1] * 2] * (r + 1)
        assert out["pad_dim1"] == [[1.0] * (r + 1) + [0.0] * (n - 1 - r)]
        assert out["trigger"] == [True, False]
    splits = [out["split"] for out in results]
    assert [x for s in splits for x in s] == list(range(7))
    assert len(splits[0]) == len(splits[-1]) + (1 if 7 % n else 0)
    padded = [out["split_padded"] for out in results]
    assert len({len(p) for p in padded}) == 1
    assert padded[-1][-1] == 6
    assert results[0]["split_padded_gathered"] == [x for p in padded for x in p]


def _gated_body() -> dict[str, Any]:
    st = accel.state()

    @accel.on_main_process
    def report() -> None:
        accel.gather(torch.zeros(1))

    start = time.monotonic()
    try:
        report()
        error = None
    except accel.errors.GatedCollectiveError as exc:
        error = str(exc)
    elapsed = time.monotonic() - start
    # the other ranks carried on: a collective all ranks make still works afterwards
    total = accel.reduce(torch.tensor([1.0])).item()
    return {"rank": st.rank, "error": error, "elapsed": elapsed, "total": total}


@pytest.mark.parametrize("world_size", [2, 3])
def test_gated_collective_raises_at_once_while_others_continue(world_size: int) -> None:
    results = run_distributed(_gated_body, world_size=world_size, timeout=30)
    assert results[0]["error"] is not None
    assert "accel.gather()" in results[0]["error"] and "on_main_process" in results[0]["error"]
    assert results[0]["elapsed"] < 1.0
    assert all(r["error"] is None for r in results[1:])
    assert all(r["total"] == world_size for r in results)


def _gated_body_uncaught() -> int:
    @accel.on_main_process
    def report() -> None:
        accel.wait_for_everyone()

    report()
    return accel.state().rank


def test_run_distributed_reraises_the_gated_error_with_its_rank() -> None:
    with pytest.raises(accel.errors.GatedCollectiveError, match="wait_for_everyone") as info:
        run_distributed(_gated_body_uncaught, world_size=2, timeout=30)
    assert "Traceback from rank 0" in str(info.value.__cause__)


def _debug_mismatch_body() -> str:
    st = accel.state()
    try:
        accel.gather(torch.zeros(2 + st.rank, 3))
    except accel.errors.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3])
def test_debug_mode_lists_every_ranks_shape(world_size: int) -> None:
    results = run_distributed(_debug_mismatch_body, world_size=world_size, debug=True, timeout=30)
    for message in results:
        for rank in range(world_size):
            assert f"rank {rank}: accel.gather(({2 + rank}, 3):torch.float32)" in message


def _debug_op_mismatch_body() -> str:
    try:
        if accel.state().rank == 0:
            accel.reduce(torch.zeros(1))
        else:
            accel.broadcast(torch.zeros(1))
    except accel.errors.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_debug_mode_catches_different_collectives() -> None:
    results = run_distributed(_debug_op_mismatch_body, world_size=2, debug=True, timeout=30)
    assert all("rank 0: accel.reduce(" in m and "rank 1: accel.broadcast(" in m for m in results)


def _debug_missing_rank_body() -> str:
    st = accel.state()
    if st.rank == 1:
        return "skipped"
    try:
        with accel.distributed(debug=True, timeout=2.0):  # scoped: accel's own waits only
            accel.gather(torch.zeros(1))
    except accel.CollectiveTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_debug_mode_names_the_rank_that_never_arrives() -> None:
    results = run_distributed(_debug_missing_rank_body, world_size=2, timeout=30)
    assert results[1] == "skipped"
    assert "ranks [1] never arrived" in results[0] and "accel.gather()" in results[0]


def _main_process_first_body(tmp: str, fail: bool) -> str:
    import pathlib

    st = accel.state()
    marker = pathlib.Path(tmp) / "cache.txt"
    try:
        with accel.main_process_first():
            if st.is_main_process:
                if fail:
                    raise OSError("disk full")
                marker.write_text("ready")
            return marker.read_text()
    except accel.errors.MainProcessFirstError as exc:
        return f"released: {exc}"
    except OSError as exc:
        return f"main raised: {exc}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_main_process_first_orders_and_releases(world_size: int, tmp_path: Any) -> None:
    ok = run_distributed(_main_process_first_body, str(tmp_path), False, world_size=world_size)
    assert ok == ["ready"] * world_size
    (tmp_path / "cache.txt").unlink()
    failed = run_distributed(_main_process_first_body, str(tmp_path), True, world_size=world_size)
    assert failed[0] == "main raised: disk full"
    assert all(r.startswith("released: Rank 0 raised") and "disk full" in r for r in failed[1:])


def _local_first_body() -> list[int]:
    order = []
    with accel.local_main_process_first():
        order.append(accel.state().local_rank)
    return order


def test_local_main_process_first() -> None:
    assert run_distributed(_local_first_body, world_size=2) == [[0], [1]]


def _print_and_log_body() -> dict[str, Any]:
    import contextlib
    import io
    import logging

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        accel.print("hello from", accel.state().rank)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = accel.get_logger("accel.mp.test", log_level="INFO")
    logger.logger.addHandler(Keep())
    logger.info("main only")
    logger.info("everyone %d", accel.state().rank, main_process_only=False)
    logger.info("ordered", in_order=True)
    return {"printed": buffer.getvalue(), "records": records}


def test_print_and_logger_on_two_ranks() -> None:
    rank0, rank1 = run_distributed(_print_and_log_body, world_size=2)
    assert rank0["printed"] == "hello from 0\n" and rank1["printed"] == ""
    assert rank0["records"] == ["main only", "everyone 0", "ordered"]
    assert rank1["records"] == ["everyone 1", "ordered"]


def _user_group_worker(rank: int, path: str, results: Any) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)  # type: ignore[attr-defined]
    with accel.distributed() as st:
        total = accel.reduce(torch.tensor([1.0])).item()
    still = dist.is_initialized()
    dist.destroy_process_group()
    results.put((rank, st.world_size, total, still))


def test_distributed_leaves_a_user_group_alone(tmp_path: Any) -> None:
    from accel.testing._forkserver import context

    ctx = context()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_user_group_worker, args=(r, str(tmp_path / "store"), results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert got == [(0, 2, 2.0, True), (1, 2, 2.0, True)]
