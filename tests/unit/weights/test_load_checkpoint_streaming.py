"""``load_checkpoint_in_model``: every checkpoint form, meta models, dtype, ties, streaming."""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import accel
from accel.errors import CheckpointError, DeviceMapError
from accel.weights import stream as _stream


class Tiny(nn.Module):
    """Embedding tied to the output head, a norm with an integer buffer, an unsaved buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.emb(x))) * self.scale.to(self.emb.weight.dtype))


X = torch.arange(16)


def _reference() -> Tiny:
    torch.manual_seed(0)
    model = Tiny().eval()
    with torch.no_grad():  # non-trivial norm statistics
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
        model.norm.num_batches_tracked.fill_(7)
    return model


def _meta() -> Tiny:
    with torch.device("meta"):
        model = Tiny()
    model.scale = torch.full((8,), 0.5)  # unsaved buffers must be real: nothing loads them
    return model.eval()


def _saved(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _write(form: str, model: nn.Module, root: Path) -> Path:
    """Write ``model`` as checkpoint ``form``; return what to pass as ``checkpoint``."""
    if form == "safetensors_file":
        accel.save(_saved(model), root / "w.safetensors")
        return root / "w.safetensors"
    if form == "torch_file":
        torch.save(model.state_dict(), root / "critic")  # the cheat sheet: no suffix
        return root / "critic"
    if form == "directory":
        accel.save_model(model, root / "d")
        return root / "d"
    if form == "sharded_directory":
        accel.save_model(model, root / "d", max_shard_size="600B")
        assert len(list((root / "d").glob("model-*.safetensors"))) > 2
        return root / "d"
    if form == "index_file":
        accel.save_model(model, root / "d", max_shard_size="600B")
        return root / "d" / "model.safetensors.index.json"
    if form == "sharded_torch":
        accel.save_model(model, root / "d", max_shard_size="600B", safe_serialization=False)
        assert len(list((root / "d").glob("pytorch_model-*.bin"))) > 2
        return root / "d"
    raise AssertionError(form)


FORMS = [
    "safetensors_file", "torch_file", "directory", "sharded_directory", "index_file",
    "sharded_torch",
]


def _no_meta(model: nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device.type == "cpu", name


@pytest.mark.parametrize("form", FORMS)
def test_every_form_loads_a_meta_model_exactly(tmp_path: Path, form: str) -> None:
    reference = _reference()
    checkpoint = _write(form, reference, tmp_path)
    model = _meta()
    assert accel.load_checkpoint_in_model(model, checkpoint, strict=True) is model
    _no_meta(model)
    assert model.head.weight is model.emb.weight  # still tied
    assert isinstance(model.body[0].weight, nn.Parameter) and model.body[0].weight.requires_grad
    assert model.norm.num_batches_tracked.item() == 7
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["safetensors_file", "sharded_torch"])
def test_an_allocated_model_is_overwritten_in_place(tmp_path: Path, form: str) -> None:
    reference = _reference()
    checkpoint = _write(form, reference, tmp_path)
    torch.manual_seed(1)
    model = Tiny().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [id(p) for p in model.parameters()]
    accel.load_checkpoint_in_model(model, checkpoint, strict=True)
    assert [id(p) for p in model.parameters()] == before  # the optimizer's params are the model's
    assert optimizer.param_groups[0]["params"][0] is model.emb.weight
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
@pytest.mark.parametrize("form", ["sharded_directory", "torch_file"])
def test_dtype_casts_floating_tensors_only(tmp_path: Path, form: str, dtype: object) -> None:
    reference = _reference()
    checkpoint = _write(form, reference, tmp_path)
    model = _meta()
    accel.load_checkpoint_in_model(model, checkpoint, dtype=dtype)  # type: ignore[arg-type]
    want = torch.bfloat16 if dtype == "bfloat16" else dtype
    assert {p.dtype for p in model.parameters()} == {want}
    assert model.norm.running_var.dtype == want
    assert model.norm.num_batches_tracked.dtype == torch.int64
    assert model.head.weight is model.emb.weight
    expected = reference.to(want)(X)  # type: ignore[arg-type]
    torch.testing.assert_close(model(X), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_a_tie_saved_under_one_name_loads_both(tmp_path: Path, suffix: str) -> None:
    reference = _reference()
    state = {k: v for k, v in _saved(reference).items() if k != "emb.weight"}  # head.weight only
    path = tmp_path / f"w{suffix}"
    if suffix == ".bin":
        torch.save(state, path)
    else:
        safetensors.torch.save_file(state, str(path))
    model = _meta()
    accel.load_checkpoint_in_model(model, path, strict=True)  # a tie counts as present
    assert model.head.weight is model.emb.weight
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)


def test_untied_model_sharing_a_torch_storage_gets_separate_tensors(tmp_path: Path) -> None:
    shared = torch.randn(4, 4)
    torch.save({"0.weight": shared, "1.weight": shared}, tmp_path / "w.pt")  # one storage
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    accel.load_checkpoint_in_model(model, tmp_path / "w.pt", strict=True)
    with torch.no_grad():
        model[0].weight.add_(1)
    torch.testing.assert_close(model[1].weight, shared)  # not aliased to the other layer


@pytest.mark.parametrize("form", ["safetensors_file", "torch_file"])
def test_cpu_weights_are_copy_on_write_views_of_the_file(tmp_path: Path, form: str) -> None:
    reference = _reference()
    checkpoint = _write(form, reference, tmp_path)
    before = checkpoint.read_bytes()
    model = _meta()
    accel.load_checkpoint_in_model(model, checkpoint)
    with torch.no_grad():
        model.body[0].weight.mul_(0)  # training writes: the file must not change
    assert checkpoint.read_bytes() == before
    assert model.body[0].weight.abs().sum() == 0
    fresh = _meta()
    accel.load_checkpoint_in_model(fresh, checkpoint)
    torch.testing.assert_close(fresh(X), reference(X), atol=1e-6, rtol=0)


def _watch_reads(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> list[tuple[Path, int]]:
    """Record, at each file read, how many tensors of earlier reads are still alive, apart
    from those the model now holds (an integer buffer is kept as read)."""
    alive: list[weakref.ref[torch.Tensor]] = []
    calls: list[tuple[Path, int]] = []
    real: Callable[..., dict[str, torch.Tensor]] = _stream.read_weights

    def watched(path: Path) -> dict[str, torch.Tensor]:
        held = {
            t.untyped_storage().data_ptr()
            for t in model.state_dict(keep_vars=True).values()
            if not t.is_meta
        }
        live = [t for t in (ref() for ref in alive) if t is not None]
        calls.append((path, sum(t.untyped_storage().data_ptr() not in held for t in live)))
        del live
        tensors = real(path)
        alive.extend(weakref.ref(t) for t in tensors.values())
        return tensors

    monkeypatch.setattr(_stream, "read_weights", watched)
    return calls


@pytest.mark.parametrize("safe", [True, False])
def test_one_file_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, safe: bool) -> None:
    reference = _reference()
    accel.save_model(reference, tmp_path, max_shard_size="600B", safe_serialization=safe)
    shards = sorted(tmp_path.glob("model-*.safetensors" if safe else "pytorch_model-*.bin"))
    model = _meta()
    calls = _watch_reads(monkeypatch, model)
    accel.load_checkpoint_in_model(model, tmp_path, dtype=torch.float16)  # casts: all copies
    # one pass over the headers, then one over the data: each file at most once, in order
    # (a shard holding only the second name of a tie has nothing left to read)
    paths = [path for path, _ in calls]
    headers, data = paths[: len(shards)], paths[len(shards) :]
    assert sorted(headers) == shards
    assert len(data) >= len(shards) - 1 and data == [p for p in headers if p in data]
    # when a file is opened, nothing read from an earlier one is alive any more
    assert [live for _, live in calls] == [0] * len(calls)
    torch.testing.assert_close(model(X), reference.half()(X), atol=1e-6, rtol=0)


def test_errors_leave_the_model_unchanged(tmp_path: Path) -> None:
    reference = _reference()
    state = _saved(reference)
    state["body.0.weight"] = torch.zeros(12, 9)
    torch.save(state, tmp_path / "bad_shape.pt")
    model = Tiny()
    before = _saved(model)
    with pytest.raises(CheckpointError, match=r"'body\.0\.weight' is \[12, 9\].*\[12, 8\]"):
        accel.load_checkpoint_in_model(model, tmp_path / "bad_shape.pt")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    del state["body.0.weight"]
    state["extra.weight"] = torch.ones(1)
    torch.save(state, tmp_path / "keys.pt")
    with pytest.raises(CheckpointError, match=r"body\.0\.weight.*extra\.weight"):
        accel.load_checkpoint_in_model(model, tmp_path / "keys.pt", strict=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_non_strict_warns_about_unexpected_and_unloaded(tmp_path: Path) -> None:
    state = _saved(_reference())
    del state["body.0.weight"]
    state["extra.weight"] = torch.ones(1)
    torch.save(state, tmp_path / "w.pt")
    model = _meta()
    with pytest.warns(UserWarning, match=r"extra\.weight|body\.0\.weight") as record:
        accel.load_checkpoint_in_model(model, tmp_path / "w.pt")
    messages = " ".join(str(w.message) for w in record)
    assert "extra.weight" in messages and "body.0.weight" in messages
    assert model.body[0].weight.is_meta and not model.body[0].bias.is_meta


class _Evil:
    """Pickles as a call to os.system: torch.load without weights_only would run it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_torch_file_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    state = _saved(_reference())
    state["evil"] = _Evil(marker)  # type: ignore[assignment]
    torch.save(state, tmp_path / "pytorch_model.bin")
    model = _meta()
    with pytest.raises(CheckpointError, match=r"refused.*weights_only=True.*posix\.system"):
        accel.load_checkpoint_in_model(model, tmp_path)
    assert not marker.exists()
    assert model.body[0].weight.is_meta  # nothing loaded


def test_bad_files(tmp_path: Path) -> None:
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"does not hold a state dict.*list"):
        accel.load_checkpoint_in_model(_meta(), tmp_path / "list.pt")
    (tmp_path / "junk.bin").write_bytes(b"\x80\x02junk" * 20)
    with pytest.raises(CheckpointError, match=r"junk\.bin"):
        accel.load_checkpoint_in_model(_meta(), tmp_path / "junk.bin")
    with pytest.raises(CheckpointError, match="dtype='int9'"):
        accel.load_checkpoint_in_model(_meta(), tmp_path / "list.pt", dtype="int9")  # type: ignore[arg-type]


def test_an_index_naming_a_missing_or_overlapping_shard(tmp_path: Path) -> None:
    accel.save_model(_reference(), tmp_path, max_shard_size="600B")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"{shards[1].name}.*missing"):
        accel.load_checkpoint_in_model(_meta(), tmp_path)
    accel.save_model(_reference(), tmp_path, max_shard_size="600B")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first = sorted(tmp_path.glob("model-*.safetensors"))[0]
    dup = tmp_path / "dup.safetensors"
    dup.write_bytes(first.read_bytes())
    index["weight_map"]["dup"] = dup.name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="stored twice"):
        accel.load_checkpoint_in_model(_meta(), tmp_path)


def test_legacy_torch_format_and_any_single_index(tmp_path: Path) -> None:
    reference = _reference()
    torch.save(reference.state_dict(), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    model = _meta()
    accel.load_checkpoint_in_model(model, tmp_path / "old.pt", strict=True)
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)
    accel.save_model(reference, tmp_path / "d", max_shard_size="600B")
    (tmp_path / "d" / "model.safetensors.index.json").rename(tmp_path / "d" / "other.index.json")
    model = _meta()
    accel.load_checkpoint_in_model(model, tmp_path / "d", strict=True)
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)


def test_device_map_places_tensors_and_refuses_disk(tmp_path: Path) -> None:
    reference = _reference()
    checkpoint = _write("sharded_directory", reference, tmp_path)
    model = _meta()
    accel.load_checkpoint_in_model(model, checkpoint, device_map={"": "cpu"}, strict=True)
    _no_meta(model)
    torch.testing.assert_close(model(X), reference(X), atol=1e-6, rtol=0)
    disk_map = {"emb": "cpu", "head": "cpu", "body": "disk", "norm": "cpu", "scale": "cpu"}
    model = _meta()
    with pytest.raises(DeviceMapError, match=r"\['body'\].*load_checkpoint_and_dispatch"):
        accel.load_checkpoint_in_model(model, checkpoint, device_map=disk_map)
    assert model.body[0].weight.is_meta
