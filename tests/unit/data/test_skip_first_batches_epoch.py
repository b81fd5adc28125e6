"""``skip_first_batches(loader, k, epoch=e)``: the tail of epoch ``e`` on 1 and 2 processes."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

import accel
from accel.data import PreparedDataLoader, prepare_data_loader, skip_first_batches
from accel.errors import ConfigError
from accel.testing import run_distributed

EPOCHS = 4
CASES: dict[str, dict[str, Any]] = {
    "shard": {},
    "split": {"split_batches": True},
    "dispatch": {"dispatch_batches": True},
}


class Counting(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loaded += 1
        return index


def _loader(data: Dataset[int], options: dict[str, Any]) -> Any:
    size = 2 * accel.state().world_size if options.get("split_batches") else 2
    return prepare_data_loader(DataLoader(data, batch_size=size, shuffle=True), **options)


def _batches(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _resume_body() -> dict[str, Any]:
    """Per case: each epoch's batches, and what a fresh loader resumed at (epoch, k) yields."""
    results: dict[str, Any] = {}
    for name, options in CASES.items():
        reference = _loader(Counting(26), options)
        epochs = []
        for epoch in range(EPOCHS):
            reference.set_epoch(epoch)
            epochs.append(_batches(reference))
        resumed: dict[str, Any] = {}
        for epoch in range(EPOCHS):
            for skip in (0, 1, len(epochs[epoch]) - 1, len(epochs[epoch])):
                data = Counting(26)
                fresh = _loader(data, options)  # a new process: its loader was not saved
                view = skip_first_batches(fresh, skip, epoch=epoch)
                assert len(view) == len(epochs[epoch]) - skip
                data.loaded = 0
                tail = _batches(view)
                loaded = data.loaded
                after = _batches(view)  # the next iteration is the next whole epoch
                resumed[f"{epoch}/{skip}"] = (tail, loaded, after, fresh.epoch)
        default = skip_first_batches(_loader(Counting(26), options), 2)
        results[name] = {"epochs": epochs, "resumed": resumed, "default": _batches(default)}
    return results


def _check(results: dict[str, Any], world_size: int) -> None:
    for name, got in results.items():
        epochs = got["epochs"]
        assert len({str(batches) for batches in epochs}) == EPOCHS, name  # shuffled per epoch
        for key, (tail, loaded, after, counter) in got["resumed"].items():
            epoch, skip = (int(part) for part in key.split("/"))
            assert tail == epochs[epoch][skip:], (name, key)
            if epoch + 1 < EPOCHS:
                assert after == epochs[epoch + 1], (name, key)
            assert counter == epoch + 2, (name, key)  # after two iterations
            if name != "dispatch" or world_size == 1:  # skipped batches are never loaded
                per_batch = len(epochs[epoch][0]) if name != "dispatch" else 2
                assert loaded <= per_batch * (len(epochs[epoch]) - skip), (name, key)
        assert got["default"] == epochs[0][2:], name  # no epoch: the loader's current one


def test_one_process_resumes_the_given_epochs_shuffle() -> None:
    with accel.distributed(seed=11):
        results = _resume_body()
    _check(results, 1)


def test_two_processes_resume_the_given_epochs_shuffle() -> None:
    results = run_distributed(_resume_body, world_size=2, seed=11)
    for result in results:
        _check(result, 2)
    for name in CASES:  # together the ranks' shards cover the epoch
        for epoch in range(EPOCHS):
            rows = [row for result in results for batch in result[name]["epochs"][epoch]
                    for row in batch]
            assert set(rows) == set(range(26)), (name, epoch)


def test_without_epoch_a_fresh_loader_replays_epoch_zero() -> None:
    with accel.distributed(seed=3):
        reference = _loader(Counting(20), {})
        first, second = _batches(reference), _batches(reference)
        assert first != second
        assert _batches(skip_first_batches(_loader(Counting(20), {}), 3)) == first[3:]
        assert _batches(skip_first_batches(_loader(Counting(20), {}), 3, epoch=1)) == second[3:]


def test_epoch_is_set_on_the_shared_counter() -> None:
    with accel.distributed(seed=5):
        loader = _loader(Counting(12), {})
        epochs = [_batches(loader) for _ in range(3)]
        loader.set_epoch(0)
        view = skip_first_batches(loader, 1, epoch=2)
        assert isinstance(view, PreparedDataLoader)
        assert loader.epoch == 2 and view.epoch == 2
        assert _batches(loader) == epochs[2]  # the loader itself starts epoch 2 from batch 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_epoch_is_a_config_error(bad: Any) -> None:
    with accel.distributed():
        loader = _loader(Counting(8), {})
        with pytest.raises(ConfigError, match=rf"epoch={bad!r} must be a non-negative integer"):
            skip_first_batches(loader, 1, epoch=bad)
        assert loader.epoch == 0
