"""Offloaded weights: mapped files, offload files, dispatch_with_sources (shards in place)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from accel.big_model.dispatch import dispatch_with_sources, remove_hooks
from accel.big_model.offload import MappedFile, TensorSource, map_sources, write_offload_file
from accel.errors import CheckpointError, DeviceMapError

ATOL = 1e-6
DISK = {"": "disk"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.body(self.embed(ids))
        return self.head(hidden), hidden


def _ids() -> torch.Tensor:
    return torch.randint(0, 7, (3, 4), generator=torch.Generator().manual_seed(2))


def _saved(tmp_path: Path) -> tuple[Net, Path]:
    """A model and its weights as one safetensors file (the tied weight stored once)."""
    torch.manual_seed(0)
    model = Net()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return model, path


def _sources(path: Path, dtype: torch.dtype | None = None) -> dict[str, TensorSource]:
    keys = load_file(path).keys()
    sources = {k: TensorSource(path, k, dtype) for k in keys}
    sources["head.weight"] = TensorSource(path, "embed.weight", dtype)  # a tie: one key
    return sources


def _meta(dtype: torch.dtype = torch.float32) -> Net:
    with torch.device("meta"):
        return Net().to(dtype)


def _same(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_dispatch_with_sources_maps_the_checkpoint_in_place(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    with torch.no_grad():
        ref = model(_ids())
    meta = _meta()
    folder = tmp_path / "offload"
    dispatch_with_sources(meta, DISK, _sources(path), offload_dir=folder)
    assert not folder.exists()  # nothing copied
    assert meta.head.weight is meta.embed.weight
    with torch.no_grad():
        _same(meta(_ids()), ref)
        _same(meta(_ids()), ref)
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_forward_on_cpu_reads_the_file_not_the_mapping(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    meta = _meta()
    dispatch_with_sources(meta, DISK, _sources(path))
    at_rest = meta.state_dict()["body.0.weight"]
    assert at_rest is meta.state_dict()["body.0.weight"]  # the same view each time
    seen: list[int] = []
    meta.body[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr()))
    with torch.no_grad():
        meta(_ids())
    # read with pread (a truncated file is an error, not a SIGBUS): not a view of the map
    assert len(seen) == 1 and seen[0] != at_rest.data_ptr()


def test_mixed_map_with_sources(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    with torch.no_grad():
        ref = model(_ids())
    meta = _meta()
    real = {k: v for k, v in model.state_dict().items() if not k.startswith("body.2")}
    meta.load_state_dict(real, strict=False, assign=True)
    meta.head.weight = meta.embed.weight
    device_map = {
        "embed": torch.device("cpu"),
        "body.0": torch.device("cpu"),
        "body.1": torch.device("cpu"),
        "body.2": "disk",
        "head": torch.device("cpu"),
    }
    sources = {k: s for k, s in _sources(path).items() if k.startswith("body.2")}
    dispatch_with_sources(meta, device_map, sources)
    assert meta.body[2].weight.device.type == "meta"
    assert meta.body[0].weight.device.type == "cpu"
    with torch.no_grad():
        _same(meta(_ids()), ref)


def test_sources_cast_to_dtype(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    model = model.double()
    with torch.no_grad():
        ref = model(_ids())
    meta = _meta(torch.float64)
    dispatch_with_sources(meta, DISK, _sources(path, torch.float64))
    assert meta.body[0].weight.dtype == torch.float64
    with torch.no_grad():
        out = meta(_ids())
    assert out[0].dtype == torch.float64
    _same(out, ref)
    with torch.inference_mode():  # the cast copy is made inside inference mode
        _same(meta(_ids()), ref)
    assert meta.state_dict()["body.0.weight"].dtype == torch.float64


def test_shape_mismatch_names_key_and_both_shapes(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    sources = _sources(path)
    sources["body.0.weight"] = TensorSource(path, "body.2.weight")
    meta = _meta()
    with pytest.raises(CheckpointError, match=r"'body\.0\.weight'.*\[8, 16\].*\[16, 8\]"):
        dispatch_with_sources(meta, DISK, sources)
    assert not hasattr(meta, "hf_device_map")  # nothing changed


def test_missing_key_is_an_error(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    sources = _sources(path)
    sources["body.0.bias"] = TensorSource(path, "body.0.nope")
    with pytest.raises(CheckpointError, match=r"no tensor 'body\.0\.nope'.*'body\.0\.bias'"):
        dispatch_with_sources(_meta(), DISK, sources)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    sources = _sources(path)
    sources["body.0.bias"] = TensorSource(tmp_path / "gone.safetensors", "body.0.bias")
    with pytest.raises(CheckpointError, match=r"gone\.safetensors.*does not exist"):
        dispatch_with_sources(_meta(), DISK, sources)


def test_source_for_unknown_name_is_an_error(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    sources = _sources(path)
    sources["body.9.weight"] = TensorSource(path, "body.0.weight")
    with pytest.raises(CheckpointError, match=r"'body\.9\.weight'.*not parameters or buffers"):
        dispatch_with_sources(_meta(), DISK, sources)


def test_meta_tensor_without_source_is_an_error(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    sources = _sources(path)
    del sources["body.0.bias"]
    with pytest.raises(DeviceMapError, match=r"'body\.0\.bias' is on the meta device"):
        dispatch_with_sources(_meta(), DISK, sources)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "only 0 bytes"),
        (b"\xff" * 8 + b"{}", "header of"),
        (b"\x04\x00\x00\x00\x00\x00\x00\x00nope", "unreadable header"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "not a JSON object"),
    ],
)
def test_invalid_file_is_an_error(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        MappedFile(path)


def test_tensor_past_end_of_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    save_file({"w": torch.ones(64)}, path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="cut short"):
        MappedFile(path)


def test_mapping_is_copy_on_write(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    meta = _meta()
    dispatch_with_sources(meta, DISK, _sources(path))
    view = meta.state_dict()["body.0.weight"]
    view.fill_(123.0)  # writes this process's private copy of the pages only
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert not bool((load_file(path)["body.0.weight"] == 123.0).any())


def test_remove_hooks_copies_mapped_weights(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    with torch.no_grad():
        ref = model(_ids())
    meta = _meta()
    dispatch_with_sources(meta, DISK, _sources(path))
    remove_hooks(meta)
    path.unlink()
    assert meta.head.weight is meta.embed.weight
    assert all(p.device.type == "cpu" for p in meta.parameters())
    with torch.no_grad():
        _same(meta(_ids()), ref)


def _rss_of(path: Path) -> int | None:
    """Resident bytes of this process's mappings of ``path`` (None without /proc)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    real = os.path.realpath(path)
    total, inside = 0, False
    for line in smaps.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):
            inside = " ".join(fields[5:]) == real  # a mapping's header line
        elif inside and fields[:1] == ["Rss:"]:
            total += int(fields[1]) * 1024
    return total


def test_pages_are_released_after_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "big.safetensors"
    save_file({"weight": torch.randn(1024, 1024), "bias": torch.randn(1024)}, path)
    with torch.device("meta"):
        layer = nn.Linear(1024, 1024)
    sources = {k: TensorSource(path, k) for k in ("weight", "bias")}
    dispatch_with_sources(layer, DISK, sources)
    resident: list[int | None] = []
    layer.register_forward_pre_hook(lambda m, a: resident.append(_rss_of(path)))
    x = torch.randn(2, 1024)
    with torch.no_grad():
        out = layer(x)
    after = _rss_of(path)
    if after is None:
        pytest.skip("no /proc/self/smaps")
    expected = x @ load_file(path)["weight"].T + load_file(path)["bias"]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert resident[0] is not None and resident[0] < 1 << 20  # not read before the forward
    assert after < 1 << 20  # the 4 MiB weight's pages were given back
    layer.state_dict()["weight"].sum()  # touching the view makes them resident (the probe works)
    assert (_rss_of(path) or 0) >= 4 << 20
    with torch.no_grad():
        layer(x)
    assert (_rss_of(path) or 0) < 1 << 20


def test_write_offload_file_round_trip_and_atomic_replace(tmp_path: Path) -> None:
    first = write_offload_file(tmp_path, {"x": torch.ones(3, 2), "i": torch.arange(4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accel-offload.safetensors"]
    loaded = load_file(tmp_path / "accel-offload.safetensors")
    assert torch.equal(loaded["x"], torch.ones(3, 2)) and torch.equal(loaded["i"], torch.arange(4))
    view = first.tensor("x")
    write_offload_file(tmp_path, {"x": torch.zeros(3, 2)})  # replaces the file by rename
    assert torch.equal(view, torch.ones(3, 2))  # the first mapping keeps its own file
    assert torch.equal(load_file(tmp_path / "accel-offload.safetensors")["x"], torch.zeros(3, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accel-offload.safetensors"]


def test_write_offload_file_rejects_dtype_without_code(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'z'.*complex64"):
        write_offload_file(tmp_path, {"z": torch.zeros(2, dtype=torch.complex64)})


def test_misaligned_tensor_is_copied_once(tmp_path: Path) -> None:
    mapped = write_offload_file(
        tmp_path, {"a": torch.tensor([1, 2, 3], dtype=torch.uint8), "b": torch.arange(4.0)}
    )
    assert mapped.is_mapped("a") and not mapped.is_mapped("b")  # b starts at byte 3
    assert torch.equal(mapped.tensor("b"), torch.arange(4.0))
    assert mapped.tensor("b") is mapped.tensor("b")
    assert mapped.releaser("b") is None


def test_map_sources_checks_everything(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(2, 3)}, path)
    found = map_sources({"m.w": TensorSource(path, "w")}, {"m.w": (2, 3)})
    mapped, key = found["m.w"]
    assert key == "w" and mapped.shape("w") == (2, 3) and mapped.dtype("w") == torch.float32
    with pytest.raises(CheckpointError, match=r"\[2, 3\].*\[3, 2\]"):
        map_sources({"m.w": TensorSource(path, "w")}, {"m.w": (3, 2)})


def test_unopenable_file_is_an_error(tmp_path: Path) -> None:
    # a folder is refused by the regular-file check (accel._files.safe_io) once opened
    with pytest.raises(CheckpointError, match="is a directory, not a regular file"):
        MappedFile(tmp_path)  # a folder


def test_unknown_dtype_in_header_is_an_error(tmp_path: Path) -> None:
    header = b'{"w":{"dtype":"X9","shape":[1],"data_offsets":[0,4]}}'
    header += b" " * (-len(header) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(CheckpointError, match="unknown dtype 'X9'"):
        MappedFile(path)


def test_map_that_does_not_place_a_tensor_is_an_error(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    with pytest.raises(DeviceMapError, match=r"does not place 'embed\.weight'"):
        dispatch_with_sources(_meta(), {"body": "disk"}, _sources(path))
