"""Torch (zip) files that torch.save never writes are refused before they are read or mapped.

``torch.load(mmap=True)`` takes each storage from its member's offset in the file, ignoring
the member's compression and size; a plain ``torch.load`` inflates compressed members into
memory sized by the pickle. The hostile files are made from real ``torch.save`` output with
``zipfile``: members deflated (torch.load itself reads that correctly, accel's mapped loads
read garbage), a storage member cut short (mapped loads read the neighbour's bytes), a local
header disagreeing with the directory, a duplicate member, and a zip bomb (2 MB declaring
2 GiB, read in a child process whose address space is bounded).
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import accel
from accel._files.torch_zip import check_torch_zip
from accel.errors import CheckpointError

Rewrite = Callable[[str, bytes], tuple[bytes, int]]  # (name, data) -> (data, zip method)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _rewrite(src: Path, dst: Path, change: Rewrite) -> None:
    """``src`` (a torch.save file) member by member into ``dst``, each changed by ``change``."""
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for info in old.infolist():
            data, method = change(info.filename, old.read(info))
            new.writestr(info.filename, data, compress_type=method)


def _deflate_all(name: str, data: bytes) -> tuple[bytes, int]:
    del name
    return data, zipfile.ZIP_DEFLATED


def _deflate_data(name: str, data: bytes) -> tuple[bytes, int]:
    return data, zipfile.ZIP_DEFLATED if "/data/" in name else zipfile.ZIP_STORED


def _shorten_first(name: str, data: bytes) -> tuple[bytes, int]:
    return (data[:-4] if name.endswith("/data/0") else data), zipfile.ZIP_STORED


def _keep(name: str, data: bytes) -> tuple[bytes, int]:
    del name
    return data, zipfile.ZIP_STORED


def _checkpoint(tmp_path: Path, change: Rewrite, name: str = "pytorch_model.bin") -> Path:
    """A folder holding the model's weights as a torch file rewritten by ``change``."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    plain = tmp_path / "plain.bin"
    torch.save(_model().state_dict(), plain)
    _rewrite(plain, folder / name, change)
    return folder


def _reference() -> dict[str, torch.Tensor]:
    return _model().state_dict()


def test_a_rewritten_but_stored_file_still_loads(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, _keep)  # not torch's alignment, but every member sound
    model = _model().apply(lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Linear) else None)
    accel.load_checkpoint_in_model(model, folder)
    for key, value in _reference().items():
        torch.testing.assert_close(model.state_dict()[key], value)
    loaded = accel.load(folder / "pytorch_model.bin")
    torch.testing.assert_close(loaded["0.weight"], _reference()["0.weight"])


@pytest.mark.parametrize("change", [_deflate_all, _deflate_data], ids=["all", "data"])
def test_deflated_members_are_refused_by_load_checkpoint_in_model(
    tmp_path: Path, change: Rewrite
) -> None:
    folder = _checkpoint(tmp_path, change)
    file = folder / "pytorch_model.bin"
    read = torch.load(file, weights_only=True)  # torch itself reads the file correctly
    torch.testing.assert_close(read["0.weight"], _reference()["0.weight"])
    model = _model()
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*member 'plain/.*"
                       r"compressed"):
        accel.load_checkpoint_in_model(model, folder)


def test_deflated_members_are_refused_by_load_checkpoint_and_dispatch(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, _deflate_data)
    with torch.device("meta"):
        model = _model()
    with pytest.raises(CheckpointError, match=r"member 'plain/data/\d+' is compressed"):
        accel.load_checkpoint_and_dispatch(model, folder, device_map={"": "cpu"})


def test_deflated_members_are_refused_by_accel_load(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, _deflate_data)
    with pytest.raises(CheckpointError, match=r"member 'plain/data/\d+' is compressed"):
        accel.load(folder / "pytorch_model.bin")


def test_deflated_members_are_refused_by_accelerate_format_load_state(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, _deflate_data)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"plain/data/\d+' is compressed"):
            accel.load_state(folder, model=model)
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value)


def test_a_shortened_storage_member_is_refused(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, _shorten_first)
    pattern = r"member 'plain/data/0' holds 124 bytes but data\.pkl declares 128"
    with pytest.raises(CheckpointError, match=pattern):
        accel.load_checkpoint_in_model(_model(), folder)
    with torch.device("meta"):
        model = _model()
    with pytest.raises(CheckpointError, match=pattern):
        accel.load_checkpoint_and_dispatch(model, folder, device_map={"": "cpu"})
    with pytest.raises(CheckpointError, match=pattern):
        accel.load(folder / "pytorch_model.bin")
    with accel.distributed(), pytest.raises(CheckpointError, match=pattern):
        accel.load_state(folder, model=_model())


def test_a_missing_storage_member_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.bin"
    torch.save(_reference(), plain)
    bad = tmp_path / "bad.bin"
    with zipfile.ZipFile(plain) as old, zipfile.ZipFile(bad, "w") as new:
        for info in old.infolist():
            if not info.filename.endswith("/data/1"):
                new.writestr(info.filename, old.read(info))
    with pytest.raises(CheckpointError, match=r"needs member 'plain/data/1', which is missing"):
        accel.load(bad)


def test_a_local_header_that_disagrees_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.bin"
    torch.save(_reference(), plain)
    with zipfile.ZipFile(plain) as archive:
        offset = next(i for i in archive.infolist() if i.filename.endswith("/data/0")).header_offset
    data = bytearray(plain.read_bytes())
    data[offset + 8 : offset + 10] = struct.pack("<H", zipfile.ZIP_DEFLATED)  # method
    plain.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"local header of member 'plain/data/0' disagrees"):
        accel.load(plain)


def test_a_duplicate_member_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.bin"
    torch.save(_reference(), plain)
    bad = tmp_path / "bad.bin"
    with zipfile.ZipFile(plain) as old, zipfile.ZipFile(bad, "w") as new, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate it writes
        for info in old.infolist():
            new.writestr(info.filename, old.read(info))
        new.writestr("plain/DATA/0", b"\0" * 128)  # torch's reader ignores case
    with pytest.raises(CheckpointError, match=r"member 'plain/DATA/0' appears twice"):
        accel.load(bad)


def test_an_unknown_storage_type_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.bin"
    torch.save({"w": torch.ones(2)}, plain)
    bad = tmp_path / "bad.bin"

    def rename(name: str, data: bytes) -> tuple[bytes, int]:
        return data.replace(b"FloatStorage", b"FloatStorX") if name.endswith(".pkl") else data, 0

    _rewrite(plain, bad, rename)
    with pytest.raises(CheckpointError, match="unknown storage type"):
        accel.load(bad)


def test_the_check_reads_only_the_directory_and_data_pkl(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(4 << 20)}, path)  # 16 MiB of tensor data

    class Counting:
        def __init__(self) -> None:
            self.file = open(path, "rb")  # noqa: SIM115 - closed below
            self.read_bytes = 0

        def read(self, size: int = -1) -> bytes:
            data = self.file.read(size)
            self.read_bytes += len(data)
            return data

        def fileno(self) -> int:  # no descriptor: every read goes through read()
            raise io.UnsupportedOperation("fileno")

        def __getattr__(self, name: str) -> object:
            return getattr(self.file, name)

    counting = Counting()
    try:
        check_torch_zip(counting, os.fspath(path))  # type: ignore[arg-type]
    finally:
        counting.file.close()
    assert counting.read_bytes < 64 << 10


@pytest.mark.slow
@pytest.mark.ci_extra
def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "weights.pt"
    os.mkfifo(fifo)
    code = f"import accel; accel.load({os.fspath(fifo)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode != 0
    assert "CheckpointError" in done.stderr and "special file" in done.stderr, done.stderr


# -- the zip bomb ---------------------------------------------------------------------------

_BOMB_BYTES = 2 << 30  # what the file declares: 2 GiB of float32 zeros
_CHUNK = 1 << 20


def _deflated_zeros(total: int) -> bytes:
    """A raw deflate stream of ``total`` zero bytes, made without compressing them all:
    each 1 MiB chunk ends in a full flush, so every chunk compresses to the same bytes."""
    chunk = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = chunk.compress(bytes(_CHUNK)) + chunk.flush(zlib.Z_FULL_FLUSH)
    end = zlib.compressobj(9, zlib.DEFLATED, -15)
    return block * (total // _CHUNK) + end.flush(zlib.Z_FINISH)


def _zip(members: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive of (name, stored bytes, method, uncompressed size, crc) members."""
    out, directory = bytearray(), bytearray()
    for name, data, method, size, crc in members:
        raw = name.encode()
        header = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0x21,
                             crc, len(data), size, len(raw), 0)
        directory += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, method, 0,
                                 0x21, crc, len(data), size, len(raw), 0, 0, 0, 0, 0, len(out))
        directory += raw
        out += header + raw + data
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members),
                      len(directory), len(out), 0)
    return bytes(out + directory + end)


def _bomb(path: Path) -> None:
    """A torch file whose one tensor (2 GiB declared) is a 2 MB deflated member."""
    numel = _BOMB_BYTES // 4
    buffer = path.parent / "small.pt"
    torch.save({"w": torch.zeros(1)}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        pickled = archive.read("small/data.pkl")
        others = [(i.filename, archive.read(i)) for i in archive.infolist()
                  if not i.filename.endswith(("/data.pkl", "/data/0"))]
    # the pickle declares the storage's element count as a 1-byte int: make it 4 bytes
    pickled = pickled.replace(b"K\x01t", b"J" + struct.pack("<i", numel) + b"t", 1)
    crc, zeros = 0, bytes(_CHUNK)
    for _ in range(_BOMB_BYTES // _CHUNK):
        crc = zlib.crc32(zeros, crc)
    members = [("small/data.pkl", pickled, 0, len(pickled), zlib.crc32(pickled))]
    members += [("small/data/0", _deflated_zeros(_BOMB_BYTES), 8, _BOMB_BYTES, crc)]
    members += [(name, data, 0, len(data), zlib.crc32(data)) for name, data in others]
    path.write_bytes(_zip(members))
    buffer.unlink()


_BOUNDED_LOAD = textwrap.dedent(
    """
    import re, resource, sys
    import accel
    from accel.errors import CheckpointError
    size = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
    limit = size * 1024 + (1 << 30)  # what is mapped now, and 1 GiB more (not 2)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        accel.load(sys.argv[1])
    except CheckpointError as exc:
        print("REFUSED", exc)
    except BaseException as exc:
        print("OTHER", type(exc).__name__, exc)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.ci_extra
def test_a_zip_bomb_is_refused_before_anything_is_inflated(tmp_path: Path) -> None:
    path = tmp_path / "bomb.pt"
    _bomb(path)
    assert path.stat().st_size < 4 << 20  # a small file...
    with zipfile.ZipFile(path) as archive:  # ...declaring 2 GiB
        assert archive.getinfo("small/data/0").file_size == _BOMB_BYTES
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _BOUNDED_LOAD, os.fspath(path)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "REFUSED" in out and "member 'small/data/0' is compressed" in out, out
