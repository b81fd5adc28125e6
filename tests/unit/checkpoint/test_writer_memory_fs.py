"""accel._files.writer on a memory filesystem (/dev/shm): a save of small files in the calling
thread; with files of 64 MiB or more, a writer per such file and a checker beside them where
the process has two CPUs (one fewer writer than CPUs), none with one CPU; the bytes and CRCs
are the same as on a disk."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from accel._files import writer as _writer
from accel._files.writer import plan_bytes, plan_safetensors, write_files

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.access("/dev/shm", os.W_OK),
    reason="needs a writable /dev/shm (Linux tmpfs)")


@pytest.fixture
def shm() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="accel-test-writer-", dir="/dev/shm"))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The max_workers of every thread pool write_files starts."""
    made: list[int] = []
    real = _writer.ThreadPoolExecutor

    def counted(max_workers: int, **kwargs: Any) -> Any:
        made.append(max_workers)
        return real(max_workers=max_workers, **kwargs)

    monkeypatch.setattr(_writer, "ThreadPoolExecutor", counted)
    monkeypatch.setattr(_writer, "_SLICE", 4096)  # many slices per file (a disk)
    monkeypatch.setattr(_writer, "_MEMORY_SLICE", 1024)  # and on /dev/shm
    return made


def _files(where: Path, count: int) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    files = [plan_safetensors(where, f"t{i}.safetensors",
                              {"w": torch.randn(64, 64, generator=g)}) for i in range(count)]
    return [*files, plan_bytes(where, "small.json", b'{"a": 1}')]


def _check(where: Path, records: list[Any]) -> None:
    for record in records:
        data = (where / record.name).read_bytes()
        assert (record.size, record.crc32) == (len(data), zlib.crc32(data))


def test_small_files_are_written_in_the_calling_thread(shm: Path, pools: list[int]) -> None:
    _check(shm, write_files(_files(shm, 3), workers=4))  # 16 KiB tensor files: all small
    assert pools == []  # no checker, no writer thread


def test_one_large_file_with_one_cpu_is_written_in_the_calling_thread(
    shm: Path, pools: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_writer, "_OWN_THREAD", 10_000)  # the tensor files count as large
    monkeypatch.setattr(_writer, "cpu_count", lambda: 1)
    files = _files(shm, 1)
    _check(shm, write_files(files, workers=4))
    assert pools == []  # no checker, no writer thread
    fd = os.open(shm / "t0.safetensors", os.O_RDONLY)
    try:  # 64 x 64 fp32 = 16 KiB of tensor: 16 slices of 1 KiB, and the header's
        assert len(_writer._File(files[0], fd).slices) == 17
    finally:
        os.close(fd)


def test_large_files_get_a_writer_each_and_a_checker(
    shm: Path, pools: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_writer, "_OWN_THREAD", 10_000)
    monkeypatch.setattr(_writer, "cpu_count", lambda: 8)
    _check(shm, write_files(_files(shm, 1), workers=4))
    assert pools == [2]  # one writer and the checker
    _check(shm, write_files(_files(shm, 2), workers=4))
    assert pools == [2, 3]
    _check(shm, write_files(_files(shm, 5), workers=4))
    assert pools == [2, 3, 4]  # at most workers - 1 writers, and the checker
    monkeypatch.setattr(_writer, "cpu_count", lambda: 2)
    _check(shm, write_files(_files(shm, 5), workers=4))
    assert pools == [2, 3, 4, 2]  # two CPUs: one writer and the checker


def test_a_disk_keeps_its_checker(tmp_path: Path, pools: list[int]) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        memory = _writer.in_memory(fd)
    finally:
        os.close(fd)
    if memory:
        pytest.skip("the temporary directory is on a memory filesystem")
    _check(tmp_path, write_files(_files(tmp_path, 1), workers=4))
    assert pools == [3]  # two writers (a tensor file, the JSON) and the checker
