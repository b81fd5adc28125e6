from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import accel
from accel.errors import CheckpointError


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), nn.BatchNorm1d(4))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sb = b.state_dict()
    return all(torch.equal(v, sb[k]) for k, v in a.state_dict().items())


def test_save_model_single_file_loads_everywhere(tmp_path: Path) -> None:
    model = _model()
    out = accel.save_model(model, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    loaded = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert set(loaded) == set(model.state_dict())
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers checks
    fresh = _model(1)
    accel.load_checkpoint_in_model(fresh, tmp_path, strict=True)
    assert _same(model, fresh)


def test_sharded_save_index_and_stale_shards(tmp_path: Path) -> None:
    model = _model()
    accel.save_model(model, tmp_path, max_shard_size="2KB")
    names = sorted(p.name for p in tmp_path.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in names
    assert all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert index["metadata"]["total_size"] == total
    for source in (tmp_path, tmp_path / "model.safetensors.index.json"):
        fresh = _model(1)
        accel.load_checkpoint_in_model(fresh, source, strict=True)
        assert _same(model, fresh)
    accel.save_model(model, tmp_path)  # one file now: the shards and index are stale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_torch_format_loads_with_weights_only(tmp_path: Path) -> None:
    model = _model()
    accel.save_model(model, tmp_path, safe_serialization=False, max_shard_size=1500)
    assert (tmp_path / "pytorch_model.bin.index.json").exists()
    fresh = _model(1)
    accel.load_checkpoint_in_model(fresh, tmp_path, strict=True)
    assert _same(model, fresh)


def test_dtype_strict_and_unwrapped_keys(tmp_path: Path) -> None:
    model = _model()
    accel.save(accel.get_state_dict(model), tmp_path / "w.safetensors")
    fresh = _model(1)
    accel.load_checkpoint_in_model(fresh, tmp_path / "w.safetensors", dtype=torch.bfloat16)
    assert fresh[0].weight.dtype == torch.bfloat16
    assert fresh[3].num_batches_tracked.dtype == torch.int64  # integers are not cast
    assert isinstance(fresh[0].weight, nn.Parameter)
    bigger = nn.Sequential(_model(1), nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match="missing keys"):
        accel.load_checkpoint_in_model(bigger, tmp_path / "w.safetensors", strict=True)
    accel.load_checkpoint_in_model(bigger, tmp_path / "w.safetensors")  # non-strict: fine


def test_save_is_atomic_and_refuses_non_tensors(tmp_path: Path) -> None:
    target = tmp_path / "w.safetensors"
    with pytest.raises(CheckpointError, match="'step' is of type int"):
        accel.save({"step": 3}, target)  # a .safetensors name holds tensors only
    assert not target.exists() and not list(tmp_path.iterdir())
    accel.save({"step": 3, "w": torch.ones(2)}, tmp_path / "obj.pt")  # any other name: torch's
    assert torch.load(tmp_path / "obj.pt", weights_only=True)["step"] == 3


def test_a_tied_weight_is_written_once_under_its_first_name(tmp_path: Path) -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ties are expected: no warning
        accel.save_model(model, tmp_path)
    loaded = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert list(loaded) == ["0.weight"] and torch.equal(loaded["0.weight"], emb.weight)
    target = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    target[1].weight = target[0].weight
    accel.load_checkpoint_in_model(target, tmp_path)
    assert torch.equal(target[1].weight, emb.weight)


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="max_shard_size='ten'"):
        accel.save_model(_model(), tmp_path, max_shard_size="ten")
    with pytest.raises(CheckpointError, match="No weights"):
        accel.load_checkpoint_in_model(_model(), tmp_path / "none")
    (tmp_path / "bad.safetensors").write_bytes(b"garbage!garbage!")
    with pytest.raises(CheckpointError, match="corrupted"):
        accel.load_checkpoint_in_model(_model(), tmp_path / "bad.safetensors")
