from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch

from accel._files.encode import decode, encode
from accel._files.format import read_safetensors, write_safetensors
from accel.errors import CheckpointError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {f"t_{str(d).split('.')[-1]}": (torch.randn(3, 5) * 10).to(d) for d in DTYPES}
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 4)
    out["strided"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    return out


def test_round_trip_and_interop_with_safetensors(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    record = write_safetensors(path, tensors, metadata={"format": "pt"})
    assert record.size == path.stat().st_size
    loaded, metadata = read_safetensors(path, expected_crc32=record.crc32)
    assert metadata == {"format": "pt"}
    theirs = safetensors.torch.load_file(str(path))
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
        assert torch.equal(theirs[name], tensor)
    # and the other way: a file safetensors wrote reads back here
    safetensors.torch.save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    assert read_safetensors(tmp_path / "y.safetensors")[0]["a"].tolist() == [1.0, 1.0]


def test_truncated_and_corrupted_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    record = write_safetensors(path, {"w": torch.randn(100)})
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"x\.safetensors.*cut short"):
        read_safetensors(path)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="CRC32"):
        read_safetensors(path, expected_crc32=record.crc32)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
    with pytest.raises(CheckpointError, match="unreadable header"):
        read_safetensors(path)
    path.write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match="only 1 bytes"):
        read_safetensors(path)


def test_encode_round_trips_optimizer_state() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tensors: dict[str, torch.Tensor] = {}
    structure = json.loads(json.dumps(encode(opt.state_dict(), tensors)))
    back = decode(structure, tensors)
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    assert back["param_groups"][0]["betas"] == (0.8, 0.95)
    assert set(back["state"]) == {0, 1}
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(back)
    expected = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], expected)


def test_encode_special_values_and_refusals() -> None:
    value = {"inf": math.inf, "nan": math.nan, "dtype": torch.bfloat16, "none": None,
             "nested": [(1, "a"), {2: True}], "__odd": 1}
    tensors: dict[str, torch.Tensor] = {}
    back = decode(json.loads(json.dumps(encode(value, tensors))), tensors)
    assert back["inf"] == math.inf and math.isnan(back["nan"])
    assert back["dtype"] is torch.bfloat16 and back["none"] is None
    assert back["nested"] == [(1, "a"), {2: True}] and back["__odd"] == 1
    with pytest.raises(CheckpointError, match=r"set at 'bad'.*without pickle"):
        encode({"bad": {1, 2}}, {})
