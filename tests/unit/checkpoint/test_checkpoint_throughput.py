"""The parallel checkpoint writer and checker: same bytes, right CRC32s, errors surfaced.

Task and slice sizes are shrunk so that small tensors are cut into many tasks that threads
finish in any order: the files must still be byte-identical to a serial write.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import accel
from accel._files import crc as _crc
from accel._files import format as _format
from accel._files import writer as _writer
from accel._files.writer import plan_bytes, plan_safetensors, write_files
from accel.errors import CheckpointError


@pytest.fixture
def small_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_writer, "_SLICE", 40)


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a": torch.randn(37, 11),
        "empty": torch.empty(0, 4),
        "b16": torch.randn(50).to(torch.bfloat16),
        "strided": torch.randn(8, 10).t(),  # not contiguous: copied to the host once
        "ints": torch.arange(300, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
    }


def test_crc32_combine_matches_zlib_on_random_splits() -> None:
    rng = random.Random(7)
    for _ in range(100):
        data = os.urandom(rng.randint(0, 5000))
        cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 5)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        joined = _crc.join_crcs([(len(p), zlib.crc32(p)) for p in pieces])
        assert joined == zlib.crc32(data)
    assert _crc.crc32_combine(0x1234, 0x5678, 0) == 0x1234  # nothing appended


def test_crc32_parallel_matches_zlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_crc, "_PART", 1000)
    data = os.urandom(12_345)
    with ThreadPoolExecutor(4) as pool:
        assert _crc.crc32_parallel(memoryview(data), pool) == zlib.crc32(data)
    assert _crc.crc32_parallel(memoryview(data), None) == zlib.crc32(data)


@pytest.mark.usefixtures("small_tasks")
def test_parallel_write_is_byte_identical_to_the_serial_writer(tmp_path: Path) -> None:
    tensors = _tensors()
    serial = _format.write_safetensors(tmp_path / "serial.safetensors", tensors, root=tmp_path)
    body = json.dumps({"x": list(range(100))}).encode()
    files = [plan_safetensors(tmp_path, "parallel.safetensors", tensors),
             plan_bytes(tmp_path, "body.json", body),
             plan_bytes(tmp_path, "empty.json", b"")]
    assert len(_writer._slices(files[0])) > 10  # many slices per file
    records = write_files(files, workers=4)
    parallel = (tmp_path / "parallel.safetensors").read_bytes()
    assert parallel == (tmp_path / "serial.safetensors").read_bytes()
    assert [r.name for r in records] == ["parallel.safetensors", "body.json", "empty.json"]
    assert (records[0].size, records[0].crc32) == (serial.size, serial.crc32)
    assert records[0].crc32 == zlib.crc32(parallel) and records[0].size == len(parallel)
    assert (records[1].size, records[1].crc32) == (len(body), zlib.crc32(body))
    assert (tmp_path / "body.json").read_bytes() == body
    assert (records[2].size, records[2].crc32) == (0, 0)
    loaded = safetensors.torch.load_file(str(tmp_path / "parallel.safetensors"))
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.usefixtures("small_tasks")
def test_save_state_manifest_checksums_match_the_files(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 30)).sum().backward()
    opt.step()
    with accel.distributed():
        path = accel.save_state(tmp_path, step=1, model=model, optimizer=opt)
    manifest = json.loads((path / "manifest.json").read_text())
    assert len(manifest["files"]) >= 6
    for entry in manifest["files"]:
        data = (path / entry["name"]).read_bytes()
        assert entry["size"] == len(data), entry
        assert entry["crc32"] == zlib.crc32(data), entry
    fresh = nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 3))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with accel.distributed():
        accel.load_state(tmp_path, model=fresh, optimizer=fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_parallel_check_on_load_finds_a_flipped_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_format, "_PARALLEL_CHECK", 100)  # every file checked in parts
    monkeypatch.setattr(_crc, "_PART", 64)
    model = nn.Linear(40, 40)
    with accel.distributed():
        path = accel.save_state(tmp_path, model=model)
        accel.load_state(tmp_path, model=nn.Linear(40, 40))  # intact: verifies in parts
        target = path / "model.safetensors"
        data = bytearray(target.read_bytes())
        data[len(data) - 300] ^= 0x01
        target.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="CRC32"):
            accel.load_state(tmp_path, model=nn.Linear(40, 40))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
@pytest.mark.usefixtures("small_tasks")
def test_a_failing_write_raises_and_closes_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = [0]
    lock = threading.Lock()
    real = os.pwrite

    def failing(fd: int, data: memoryview, offset: int) -> int:
        with lock:
            calls[0] += 1
            if calls[0] == 5:
                raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    before = _open_fds()
    files = [plan_safetensors(tmp_path, f"f{i}.safetensors", _tensors()) for i in range(3)]
    with pytest.raises(OSError, match="No space left"):
        write_files(files)
    assert _open_fds() == before


def test_a_missing_directory_raises_before_writing(tmp_path: Path) -> None:
    files = [plan_bytes(tmp_path / "missing", "x.json", b"{}")]
    with pytest.raises(FileNotFoundError):
        write_files(files)


@pytest.mark.usefixtures("small_tasks")
def test_a_cancelled_write_stops_with_interrupted_error(tmp_path: Path) -> None:
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(accel.errors.CheckpointCancelledError, match="cancelled") as info:
        write_files([plan_safetensors(tmp_path, "x.safetensors", _tensors())],
                    cancelled=cancelled)
    assert isinstance(info.value, InterruptedError)


def test_writeback_hint_is_a_no_op_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    hint = _writer._start_writeback()
    hint(-1, 0, 10)  # a bad descriptor is never touched


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writeback_hint_accepts_a_real_file(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"x" * 4096)
        _writer._start_writeback()(fd, 0, 4096)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"x" * 4096


def test_crc32_is_zlibs_checksum_with_or_without_isal(monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(10_000)
    assert _crc.crc32(data) == zlib.crc32(data)
    assert _crc.crc32(data[5000:], _crc.crc32(data[:5000])) == zlib.crc32(data)
    monkeypatch.setitem(sys.modules, "isal", None)  # as if not installed: ImportError
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    function, fast = _crc._pick()
    assert function is zlib.crc32 and not fast


def test_a_fast_crc32_that_disagrees_with_zlib_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    fake = types.ModuleType("isal")
    wrong = types.SimpleNamespace(crc32=lambda data, value=0: 7)
    fake.isal_zlib = wrong  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "isal", fake)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", wrong)
    function, fast = _crc._pick()
    assert function is zlib.crc32 and not fast


@pytest.mark.usefixtures("small_tasks")
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_every_slice_is_checksummed_once_whoever_claims_it(
    tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def counted(data: object, value: int = 0) -> int:
        with lock:
            calls.append(len(memoryview(data)))  # type: ignore[arg-type]
        return zlib.crc32(data, value)  # type: ignore[arg-type]

    monkeypatch.setattr(_crc, "crc32", counted)
    tensors = _tensors()
    files = [plan_safetensors(tmp_path, f"f{i}.safetensors", tensors) for i in range(3)]
    records = write_files(files, workers=workers)
    total = 0
    for record in records:
        data = (tmp_path / record.name).read_bytes()
        assert (record.size, record.crc32) == (len(data), zlib.crc32(data))
        total += len(data)
    assert sum(calls) == total  # no byte checksummed twice, none skipped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fstatfs is Linux's")
def test_memory_filesystems_get_no_writeback_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    hints: list[int] = []
    monkeypatch.setattr(_writer, "_writeback", lambda fd, offset, length: hints.append(fd))
    where = Path(tempfile.mkdtemp(dir=shm))
    try:
        fd = os.open(where / "probe", os.O_WRONLY | os.O_CREAT)
        try:
            memory = _writer.in_memory(fd)
        finally:
            os.close(fd)
        records = write_files([plan_safetensors(where, "x.safetensors", _tensors())])
        assert records[0].crc32 == zlib.crc32((where / "x.safetensors").read_bytes())
    finally:
        shutil.rmtree(where)
    assert memory == (hints == [])  # tmpfs: no hint; another filesystem there: hints
    fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        on_disk = _writer.in_memory(fd)
    finally:
        os.close(fd)
    write_files([plan_safetensors(tmp_path, "y.safetensors", _tensors())])
    assert on_disk or hints  # a disk-backed tmp_path gets the hint
