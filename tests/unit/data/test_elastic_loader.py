"""A loader position saved at one world size resumes at another at the same global sample
(elastic restarts): mid-epoch, and at the end of an epoch whatever padding the saved world made.

Faked ranks (no processes): each rank's loader is prepared under ``fake_state`` and the global
order is read back by interleaving the ranks (global batch ``i`` is rank ``i % W``'s).
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader, IterableDataset

import accel
from accel.errors import CheckpointError
from accel.testing import fake_state

Batches = list[tuple[int, list[int]]]  # (epoch, sample indices)


class _Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _rank_run(world: int, rank: int, data: Any, *, state: dict[str, Any] | None = None,
              take: int | None = None, epochs: int = 2) -> tuple[Batches, dict[str, Any]]:
    """This rank's batches over ``epochs`` (from a restored ``state``), stopping after
    ``take`` batches; and the loader's state there."""
    with fake_state(rank=rank, world_size=world, seed=11):
        shuffle = not isinstance(data, IterableDataset)
        loader = accel.prepare_data_loader(
            DataLoader(data, batch_size=2, shuffle=shuffle), dispatch_batches=False
        )
        if state is not None:
            loader.load_state_dict(state)
        out: Batches = []
        for epoch in range(loader.epoch, epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                out.append((epoch, batch.tolist()))
                if take is not None and len(out) == take:
                    return out, loader.state_dict()
        return out, loader.state_dict()


def _global(world: int, data: Any, **kwargs: Any) -> Batches:
    """The global order: per epoch, round ``j`` holds rank 0's ``j``-th batch, rank 1's..."""
    runs = [_rank_run(world, rank, data, **kwargs)[0] for rank in range(world)]
    out: Batches = []
    for epoch in sorted({e for run in runs for e, _ in run}):
        mine = [[b for e, b in run if e == epoch] for run in runs]
        for j in range(max(map(len, mine))):
            out += [(epoch, lane[j]) for lane in mine if j < len(lane)]
    return out


def _real(batches: Batches, per_epoch: int, done: int = 0) -> Batches:
    """Drop each epoch's padding: epoch 0 has ``per_epoch - done`` real batches left."""
    out: Batches = []
    for epoch in sorted({e for e, _ in batches}):
        keep = per_epoch - (done if epoch == 0 else 0)
        out += [item for item in batches if item[0] == epoch][:keep]
    return out


@pytest.mark.parametrize("data", [list(range(16)), list(range(14)), _Stream(14)],
                         ids=["map-even", "map-padded", "stream-padded"])
@pytest.mark.parametrize("resume_world", [1, 4])
def test_saved_at_two_resumes_at_the_same_global_sample(data: Any, resume_world: int) -> None:
    per_epoch = len(data) // 2  # global batches of 2 samples
    uninterrupted = _real(_global(2, data), per_epoch)
    for take in (1, 2, 3):  # batches per rank before the save: 2, 4 and 6 global ones
        if (take * 2) % resume_world:
            continue  # not a whole number of the new world's rounds (refused, see below)
        saved = _rank_run(2, 0, data, take=take)[1]
        assert _rank_run(2, 1, data, take=take)[1] == saved  # every rank saves the same
        resumed = _global(resume_world, data, state=saved)
        done = take * 2
        assert _real(resumed, per_epoch, done) == uninterrupted[done:], (take, resume_world)


@pytest.mark.parametrize("n", [10, 12])
@pytest.mark.parametrize("resume_world", [1, 3, 4])
def test_a_position_at_the_epoch_end_resumes_at_any_world(n: int, resume_world: int) -> None:
    # 10 samples = 5 batches: at world 2 each rank yields 3 (one padded), 6 "done" - which
    # 4 or 3 processes could not divide before epoch_done was recorded (CheckpointError).
    data = list(range(n))
    last = -(-(n // 2) // 2)
    saved = _rank_run(2, 0, data, take=last)[1]
    assert saved["epoch"] == 0 and saved["epoch_done"] == 1
    resumed = _global(resume_world, data, state=saved)
    assert [e for e, _ in resumed] == [1] * len(resumed)  # straight to the next epoch
    assert _real(resumed, n // 2) == _real(_global(2, data), n // 2)[n // 2:]
    # at the same world size the position round-trips
    with fake_state(rank=0, world_size=2, seed=11):
        loader = accel.prepare_data_loader(DataLoader(data, batch_size=2, shuffle=True))
        loader.load_state_dict(saved)
        assert loader.state_dict() == saved


def test_a_position_no_world_can_continue_is_still_refused() -> None:
    saved = _rank_run(2, 0, list(range(16)), take=1)[1]  # 2 global batches done
    with pytest.raises(CheckpointError, match="cannot be continued by 4 processes"):
        _rank_run(4, 0, list(range(16)), state=saved)
    with pytest.raises(CheckpointError, match="'epoch_done' must be 0 or 1"):
        _rank_run(1, 0, list(range(16)), state={**saved, "epoch_done": "yes"})
