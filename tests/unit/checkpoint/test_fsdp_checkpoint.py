"""FSDP checkpoint pieces on one process: hand-built sharded checkpoints, reassembly, errors.

The multi-process behaviour (saving on N ranks, loading on M) is in
``tests/multiproc/test_fsdp_checkpoint.py``; here the sharded layout is written by hand (the
structure file plus per-rank piece files, exactly as ``save_state`` writes them) and read back
into plain objects, which is what loading on one process does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel._files.objects import plan_object
from accel._files.writer import write_files
from accel.checkpoint._fit import check_fits
from accel.checkpoint.sharded import pieces as _sharded
from accel.checkpoint.sharded import reshard as _reshard
from accel.errors import CheckpointArgumentError, CheckpointError
from accel.weights import full as _full_weights

REF = _sharded.SHARD_REF


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))


def _write(tmp: Path, name: str, state: Any, extra: dict[str, Any]) -> dict[str, Any]:
    records = write_files(plan_object(tmp, name, state, extra))
    return {r.name: {"size": r.size, "crc32": r.crc32} for r in records}


def _rows(tensor: torch.Tensor, ranks: int) -> list[tuple[int, torch.Tensor]]:
    size = -(-tensor.shape[0] // ranks)
    return [(r * size, tensor[r * size:(r + 1) * size]) for r in range(ranks)]


def _sharded_checkpoint(
    tmp: Path, name: str, state: dict[str, Any], ranks: int = 2
) -> dict[str, Any]:
    """Write ``state`` (flat, name -> tensor) as ``ranks`` ranks' pieces + the structure."""
    skeleton = {k: {REF: k} for k in state}
    meta = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            for k, v in state.items()}
    files = _write(tmp, name, skeleton, {"sharded": meta})
    for rank in range(ranks):
        pieces, where = {}, {}
        for key, value in state.items():
            start, piece = _rows(value, ranks)[rank]
            if piece.numel():
                pieces[key] = piece.clone()
                where[key] = {"offset": [start] + [0] * (value.dim() - 1),
                              "shape": list(piece.shape)}
        files.update(_write(tmp, f"{name}{_sharded.SHARDS}_rank{rank}", pieces,
                            {"pieces": where}))
    return files


def _load(tmp: Path, files: dict[str, Any], objects: dict[str, Any]) -> dict[str, Any]:
    from accel._files.objects import read_object

    loaded = {name: read_object(tmp, name, files) for name in objects}
    _reshard.resolve(tmp, files, objects, loaded)
    for name, obj in objects.items():
        check_fits(name, obj, loaded[name][0])
    return loaded


def test_pieces_of_two_ranks_reassemble_into_a_plain_model(tmp_path: Path) -> None:
    source = _net()
    for p in source.parameters():
        p.data.add_(1.0)
    files = _sharded_checkpoint(tmp_path, "model", source.state_dict(), ranks=3)
    target = _net()
    loaded = _load(tmp_path, files, {"model": target})
    target.load_state_dict(loaded["model"][0])
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_fqn_keyed_optimizer_state_becomes_the_optimizers_own(tmp_path: Path) -> None:
    model = _net()
    names = [n for n, _ in model.named_parameters()]
    moments = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    skeleton = {
        "state": {n: {"step": torch.tensor(4.0), "exp_avg": {REF: f"state.{n}.exp_avg"}}
                  for n in names},
        "param_groups": [{"lr": 0.5, "params": list(reversed(names))}],
    }
    meta = {f"state.{n}.exp_avg": {"shape": list(m.shape), "dtype": "float32"}
            for n, m in moments.items()}
    files = _write(tmp_path, "optimizer", skeleton, {"sharded": meta, "fqn_keys": True})
    pieces = {f"state.{n}.exp_avg": m for n, m in moments.items()}
    where = {k: {"offset": [0] * v.dim(), "shape": list(v.shape)} for k, v in pieces.items()}
    files.update(_write(tmp_path, "optimizer__shards_rank0", pieces, {"pieces": where}))
    files.update(_write(tmp_path, "model", model.state_dict(), {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loaded = _load(tmp_path, files, {"model": model, "optimizer": optimizer})["optimizer"]
    state = loaded[0]
    assert state["param_groups"][0]["params"] == [0, 1, 2, 3]  # the optimizer's own order
    assert state["param_groups"][0]["lr"] == 0.5
    for index, name in enumerate(names):
        assert torch.equal(state["state"][index]["exp_avg"], moments[name])
        assert float(state["state"][index]["step"]) == 4.0


def test_fqn_keyed_optimizer_without_its_model_is_refused(tmp_path: Path) -> None:
    model = _net()
    names = [n for n, _ in model.named_parameters()]
    files = _write(tmp_path, "optimizer", {"state": {}, "param_groups": [
        {"lr": 0.5, "params": names}]}, {"fqn_keys": True})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointArgumentError, match="pass the model too"):
        _load(tmp_path, files, {"optimizer": optimizer})


def test_fqn_keyed_optimizer_over_other_parameters_is_refused(tmp_path: Path) -> None:
    model = _net()
    files = _write(tmp_path, "optimizer", {"state": {}, "param_groups": [
        {"lr": 0.5, "params": ["0.weight", "0.bias", "9.weight", "9.bias"]}]},
        {"fqn_keys": True})
    files.update(_write(tmp_path, "model", model.state_dict(), {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="same parameters"):
        _load(tmp_path, files, {"model": model, "optimizer": optimizer})


def test_a_missing_piece_file_is_named(tmp_path: Path) -> None:
    files = _sharded_checkpoint(tmp_path, "model", _net().state_dict())
    del files["model__shards_rank1.json"]  # the manifest does not list rank 1's pieces
    with pytest.raises(CheckpointError, match=r"cover \d+ of the \d+ values"):
        _load(tmp_path, files, {"model": _net()})


def test_a_piece_file_lacking_its_tensor_is_corrupt(tmp_path: Path) -> None:
    state = _net().state_dict()
    files = _sharded_checkpoint(tmp_path, "model", state)
    # rank 1's piece list names "0.weight", but its tensor file now holds other tensors only
    pieces = {"1.bias": state["1.bias"][1:].clone()}
    where = {"0.weight": {"offset": [3, 0], "shape": [2, 3]},
             "1.bias": {"offset": [1], "shape": [1]}}
    files.update(_write(tmp_path, "model__shards_rank1", pieces, {"pieces": where}))
    with pytest.raises(CheckpointError, match=re.escape("lacks its piece of '0.weight'")):
        _load(tmp_path, files, {"model": _net()})


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"0.weight": {"shape": [5, 3], "dtype": "pickle"}}, "has dtype 'pickle'"),
        ({"0.weight": {"dtype": "float32"}}, "no global shape for '0.weight'"),
        (["not", "a", "mapping"], "'sharded' entry is not an object"),
    ],
)
def test_bad_structure_metadata_is_corrupt(tmp_path: Path, meta: Any, match: str) -> None:
    files = _sharded_checkpoint(tmp_path, "model", {"0.weight": torch.ones(5, 3)})
    files.update(_write(tmp_path, "model", {"0.weight": {REF: "0.weight"}}, {"sharded": meta}))
    target = nn.Sequential(nn.Linear(3, 5, bias=False))
    with pytest.raises(CheckpointError, match=re.escape(match)):
        _load(tmp_path, files, {"model": target})


def test_a_piece_file_without_a_piece_list_is_corrupt(tmp_path: Path) -> None:
    files = _sharded_checkpoint(tmp_path, "model", _net().state_dict())
    files.update(_write(tmp_path, "model__shards_rank0", {}, {"nothing": 1}))
    with pytest.raises(CheckpointError, match=re.escape("rank0.json has no piece list")):
        _load(tmp_path, files, {"model": _net()})


def test_a_flipped_byte_in_a_piece_list_fails_its_crc(tmp_path: Path) -> None:
    files = _sharded_checkpoint(tmp_path, "model", _net().state_dict())
    victim = tmp_path / "model__shards_rank0.json"
    data = bytearray(victim.read_bytes())
    data[5] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="CRC32"):
        _load(tmp_path, files, {"model": _net()})


def test_a_shard_reference_in_a_plain_object_is_refused(tmp_path: Path) -> None:
    files = _write(tmp_path, "model", {"0.weight": {REF: "0.weight"}}, {"fqn_keys": False})
    # neither sharded nor keyed by name, and the target holds no DTensor: left to check_fits
    with pytest.raises(CheckpointError, match="other shapes"):
        _load(tmp_path, files, {"model": nn.Sequential(nn.Linear(3, 5, bias=False))})
    with pytest.raises(CheckpointError, match="outside a sharded object"):
        _reshard._convert({REF: "0.weight"}, None, None, "The checkpoint's model['0.weight']")


def test_split_replaces_each_dtensor_by_a_reference() -> None:
    class Marked(torch.Tensor):
        pass

    a = torch.ones(2).as_subclass(Marked)
    b = torch.zeros(3).as_subclass(Marked)
    found: dict[str, Any] = {}
    state = {"state": {"w": {"exp_avg": a, "step": torch.tensor(1.0)}},
             "groups": [{"lr": 0.1, "x": (b, 2)}], "w": {"exp_avg": a}}
    skeleton = _sharded._split(state, Marked, found)
    assert skeleton["state"]["w"]["exp_avg"] == {REF: "state.w.exp_avg"}
    assert skeleton["groups"][0]["x"] == ({REF: "groups.0.x.0"}, 2)
    assert isinstance(skeleton["state"]["w"]["step"], torch.Tensor)
    assert set(found) == {"state.w.exp_avg", "groups.0.x.0", "w.exp_avg"}
    json.dumps({k: v for k, v in skeleton.items() if k != "state"})  # references are JSON


def test_plain_objects_take_the_ordinary_paths() -> None:
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters())
    assert _full_weights.sharded_state(model) is None
    for obj in (model, optimizer):
        assert _sharded.plan_sharded(Path("unused"), "x", obj, {}, 0, True, None) is None
    _sharded.check_layout({"model": model}, True, "save_state")  # nothing sharded: accepted
    sd = accel.get_state_dict(model)
    assert all(sd[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items())
