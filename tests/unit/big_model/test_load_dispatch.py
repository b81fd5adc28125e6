"""``load_checkpoint_and_dispatch``: checkpoint forms x device maps, offload, dtype, ties."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

import accel
from accel.errors import AccelError, CheckpointError, DeviceMapError
from accel.weights import stream as _stream

WIDTH = 32


class Block(nn.Module):
    """A residual block: a device map must keep it whole when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Token embedding tied to the output head around a stack of blocks (~140 KB fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(4)))
        self.head = nn.Linear(WIDTH, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


X = torch.arange(32).reshape(4, 8)
SMALL = {"cpu": "60KB"}  # fits the embedding and a block or two: the rest goes to disk
EXPLICIT = {"emb": "cpu", "head": "cpu", "blocks.0": "cpu", "blocks.1": "disk",
            "blocks.2": "cpu", "blocks.3": "disk"}


def _reference() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _empty() -> Net:
    with accel.init_empty_weights():
        model = Net()
    return model.eval()


def _write(form: str, model: nn.Module, root: Path) -> Path:
    """Write ``model`` as checkpoint ``form``; return what to pass as ``checkpoint``."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if form == "safetensors_file":
        safetensors.torch.save_file(state, str(root / "weights.safetensors"))
        return root / "weights.safetensors"
    if form == "torch_file":
        torch.save(model.state_dict(), root / "critic")  # the cheat sheet's flow
        return root / "critic"
    if form == "torch_directory":
        (root / "d").mkdir()
        torch.save(model.state_dict(), root / "d" / "pytorch_model.bin")
        return root / "d"
    shard = "10GB" if form == "directory" else "40KB"
    accel.save_model(model, root / "d", max_shard_size=shard)  # the tied embedding: once
    if form == "sharded_directory":
        return root / "d"
    if form == "index_file":
        return root / "d" / "model.safetensors.index.json"
    assert form == "directory"
    return root / "d"


SAFE_FORMS = ["safetensors_file", "directory", "sharded_directory", "index_file"]
FORMS = [*SAFE_FORMS, "torch_file", "torch_directory"]
MAPS: dict[str, dict[str, object]] = {
    "auto": {"device_map": "auto", "max_memory": {"cpu": "1GB"}},
    "sequential_disk": {"device_map": "sequential", "max_memory": SMALL},
    "balanced_disk": {"device_map": "balanced", "max_memory": SMALL},
    "explicit_disk": {"device_map": EXPLICIT},
    "none": {"device_map": None},
}


def _tensor_bytes(folder: Path) -> int:
    """Bytes of tensor data under ``folder`` (safetensors files and anything else big)."""
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.suffix != ".json")


@pytest.mark.parametrize("maps", list(MAPS))
@pytest.mark.parametrize("form", FORMS)
def test_outputs_match_the_full_model(tmp_path: Path, form: str, maps: str) -> None:
    reference = _reference()
    checkpoint = _write(form, reference, tmp_path)
    offload = tmp_path / "offload"
    model = _empty()
    out = accel.load_checkpoint_and_dispatch(model, checkpoint, offload_folder=offload,
                                             **MAPS[maps])  # type: ignore[arg-type]
    assert out is model
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)
        torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)  # hooks repeat
    if maps == "none":
        assert not hasattr(model, "hf_device_map")
        assert all(not p.is_meta for p in model.parameters())
        return
    placed = set(model.hf_device_map.values())
    if maps == "auto":
        assert placed == {"cpu"}
        assert all(not p.is_meta for p in model.parameters())
        return
    assert "disk" in placed and "cpu" in placed, model.hf_device_map
    if form in SAFE_FORMS:
        assert _tensor_bytes(offload) == 0  # shards are mapped where they are, never copied
    else:
        written = sorted(offload.glob("*.safetensors"))
        assert written, "a torch file's disk weights are written to the offload folder"
        with safetensors.safe_open(str(written[0]), framework="pt") as f:
            keys = set(f.keys())
        on_disk = {n for n, d in model.hf_device_map.items() if d == "disk"}
        assert keys and all(any(k.startswith(f"{n}.") for n in on_disk) for k in keys)


def _inside_blocks(device_map: dict[str, object]) -> list[str]:
    return [n for n in device_map if n.startswith("blocks.") and n.count(".") > 1]


@pytest.mark.parametrize("split", [[Block], ["Block"]])
def test_no_split_module_classes_keep_blocks_whole(tmp_path: Path, split: list[object]) -> None:
    reference = _reference()
    checkpoint = _write("sharded_directory", reference, tmp_path)
    options: dict[str, object] = {"device_map": "sequential", "max_memory": SMALL}
    free = accel.load_checkpoint_and_dispatch(_empty(), checkpoint, **options)  # type: ignore[arg-type]
    assert _inside_blocks(free.hf_device_map)  # this budget splits a block when allowed
    model = accel.load_checkpoint_and_dispatch(
        _empty(), checkpoint, no_split_module_classes=split, **options  # type: ignore[arg-type]
    )
    assert not _inside_blocks(model.hf_device_map), model.hf_device_map
    assert "disk" in model.hf_device_map.values()
    for dispatched in (free, model):
        with torch.no_grad():
            torch.testing.assert_close(dispatched(X), reference(X), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["sharded_directory", "torch_file"])
def test_dtype_with_disk_offload(tmp_path: Path, form: str, dtype: torch.dtype) -> None:
    reference = _reference()
    checkpoint = _write(form, reference, tmp_path)
    model = accel.load_checkpoint_and_dispatch(
        _empty(), checkpoint, device_map=EXPLICIT, offload_folder=tmp_path / "off", dtype=dtype
    )
    assert model.emb.weight.dtype == dtype and model.blocks[0].fc1.weight.dtype == dtype
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference.to(dtype)(X), atol=1e-6, rtol=0)


@pytest.mark.parametrize("names", ["both", "one"])
@pytest.mark.parametrize("tied_on", ["cpu", "disk"])
def test_tied_weights_end_tied(tmp_path: Path, names: str, tied_on: str) -> None:
    reference = _reference()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    if names == "one":
        del state["head.weight"]  # what transformers writes for a tied head
    safetensors.torch.save_file(state, str(tmp_path / "w.safetensors"))
    device_map = {**EXPLICIT, "emb": tied_on, "head": tied_on}
    model = _empty()
    accel.load_checkpoint_and_dispatch(model, tmp_path / "w.safetensors", device_map=device_map)
    if tied_on == "cpu":
        assert model.head.weight is model.emb.weight and not model.emb.weight.is_meta
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)


def test_inside_init_empty_weights_and_a_real_model(tmp_path: Path) -> None:
    reference = _reference()
    checkpoint = _write("torch_file", reference, tmp_path)
    with accel.init_empty_weights():  # as Accelerate's docs write it
        model = Net()
        model = accel.load_checkpoint_and_dispatch(model, checkpoint, device_map="auto")
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)
    torch.manual_seed(5)
    real = Net().eval()  # allocated weights: the disk ones are dropped, then mapped
    accel.load_checkpoint_and_dispatch(real, _write("directory", reference, tmp_path),
                                       device_map=EXPLICIT)
    torch.testing.assert_close(real(X), reference(X), atol=1e-6, rtol=0)


def test_disk_weights_of_a_safetensors_shard_are_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _reference()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    disk = {k: v for k, v in state.items() if k.startswith(("blocks.1.", "blocks.3."))}
    safetensors.torch.save_file(disk, str(tmp_path / "model-00002-of-00002.safetensors"))
    rest = {k: v for k, v in state.items() if k not in disk}
    safetensors.torch.save_file(rest, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {'
        + ", ".join(f'"{k}": "model-0000{1 if k in rest else 2}-of-00002.safetensors"'
                    for k in state)
        + "}}"
    )
    reads: list[str] = []
    real: Callable[..., dict[str, torch.Tensor]] = _stream.read_weights
    def counted(path: Path) -> dict[str, torch.Tensor]:
        reads.append(path.name)
        return real(path)

    monkeypatch.setattr(_stream, "read_weights", counted)
    model = accel.load_checkpoint_and_dispatch(_empty(), tmp_path, device_map=EXPLICIT)
    # headers of both, then the data of the first only
    assert reads.count("model-00002-of-00002.safetensors") == 1
    assert reads.count("model-00001-of-00002.safetensors") == 2
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)


def test_one_file_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _reference()
    checkpoint = _write("sharded_directory", reference, tmp_path)
    alive: list[weakref.ref[torch.Tensor]] = []
    live_at_read: list[int] = []
    real: Callable[..., dict[str, torch.Tensor]] = _stream.read_weights

    def watched(path: Path) -> dict[str, torch.Tensor]:
        live_at_read.append(sum(ref() is not None for ref in alive))
        tensors = real(path)
        alive.extend(weakref.ref(t) for t in tensors.values())
        return tensors

    monkeypatch.setattr(_stream, "read_weights", watched)
    model = accel.load_checkpoint_and_dispatch(
        _empty(), checkpoint, device_map="sequential", max_memory=SMALL, dtype=torch.float16
    )
    assert len(live_at_read) > 4 and set(live_at_read) == {0}
    torch.testing.assert_close(model(X), reference.half()(X), atol=1e-6, rtol=0)


def test_missing_shape_and_unexpected_keys(tmp_path: Path) -> None:
    reference = _reference()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del state["blocks.2.fc1.bias"]
    torch.save(state, tmp_path / "missing.pt")
    model = _empty()
    with pytest.raises(CheckpointError, match=r"blocks\.2\.fc1\.bias.*meta device"):
        accel.load_checkpoint_and_dispatch(model, tmp_path / "missing.pt")
    assert all(p.is_meta for p in model.parameters())  # nothing changed

    state["blocks.2.fc1.bias"] = torch.zeros(3)
    torch.save(state, tmp_path / "shape.pt")
    with pytest.raises(CheckpointError, match=r"'blocks\.2\.fc1\.bias' is \[3\].*\[128\]"):
        accel.load_checkpoint_and_dispatch(model, tmp_path / "shape.pt")
    assert all(p.is_meta for p in model.parameters())

    state["blocks.2.fc1.bias"] = reference.blocks[2].fc1.bias.detach().clone()
    state["lm_extra.weight"] = torch.ones(2)
    torch.save(state, tmp_path / "extra.pt")
    with pytest.warns(UserWarning, match=r"lm_extra\.weight"):
        accel.load_checkpoint_and_dispatch(model, tmp_path / "extra.pt")
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)


def test_disk_from_a_torch_file_needs_an_offload_folder(tmp_path: Path) -> None:
    checkpoint = _write("torch_file", _reference(), tmp_path)
    model = _empty()
    with pytest.raises(DeviceMapError, match=r"blocks\.1.*offload_folder is None"):
        accel.load_checkpoint_and_dispatch(model, checkpoint, device_map=EXPLICIT)
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(DeviceMapError, match="offload_folder"):
        accel.load_checkpoint_and_dispatch(model, checkpoint, device_map="sequential",
                                           max_memory=SMALL)


def test_bad_options(tmp_path: Path) -> None:
    checkpoint = _write("safetensors_file", _reference(), tmp_path)
    with pytest.raises(DeviceMapError, match="'lots'"):
        accel.load_checkpoint_and_dispatch(_empty(), checkpoint, max_memory={"cpu": "lots"})
    with pytest.raises(DeviceMapError, match="'fastest'"):
        accel.load_checkpoint_and_dispatch(_empty(), checkpoint, device_map="fastest")
    with pytest.raises(CheckpointError, match="No weights"):
        accel.load_checkpoint_and_dispatch(_empty(), tmp_path / "nothing")
    with pytest.raises(AccelError, match="dtype='half-ish'"):
        accel.load_checkpoint_and_dispatch(_empty(), checkpoint, dtype="half-ish")


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_checkpoint_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    state: dict[str, object] = dict(_reference().state_dict())
    state["config"] = _Evil(marker)
    torch.save(state, tmp_path / "critic")
    model = _empty()
    with pytest.raises(CheckpointError, match="refused"):
        accel.load_checkpoint_and_dispatch(model, tmp_path / "critic", device_map="auto")
    assert not marker.exists()
    assert all(p.is_meta for p in model.parameters())
