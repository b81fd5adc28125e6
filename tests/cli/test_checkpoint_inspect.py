"""`accel checkpoint inspect` and `accel checkpoint verify` on real and damaged checkpoints.

The CLI runs in this process (`main([...])`). A 2-process FSDP checkpoint shows its mesh and
global tensor shapes; damaged copies (truncated, flipped byte, missing file, pieces that no
longer cover a tensor) make `verify` exit 1 listing each problem.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import accel
from accel.cli.main import main
from accel.testing import run_distributed
from tests.tied_models import loss_of, tokens, toy


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["checkpoint", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Two numbered one-process checkpoints (steps 3 and 7) of a tied model and AdamW."""
    model = toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (3, 7):
        accel.backward(loss_of(model, tokens(step)))
        optimizer.step()
        accel.save_state(tmp_path / "ckpt", step=step, model=model, optimizer=optimizer)
    return tmp_path / "ckpt"


def test_inspect_json_describes_steps_objects_files_and_tensors(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "inspect", str(root), "--tensors", "--json")
    assert code == 0
    report: dict[str, Any] = json.loads(out)
    assert report["path"] == str(root / "checkpoint_7")  # the newest of the root
    assert [(c["step"], c["complete"]) for c in report["checkpoints"]] == [(7, True), (3, True)]
    assert (report["format"], report["step"], report["world_size"], report["ranks"]) == (
        "accel", 7, 1, [0])
    assert report["mesh"] is None and report["problems"] == []
    objects = {o["name"]: o for o in report["objects"]}
    assert objects["model"]["kind"] == "model" and objects["model"]["layout"] == "full"
    assert objects["model"]["tied"] == {"head.weight": "embed.weight"}
    assert objects["optimizer"]["kind"] == "optimizer"
    tensors = {t["name"]: t for t in objects["model"]["tensors"]}
    assert tensors["embed.weight"] == {"name": "embed.weight", "shape": [37, 13],
                                       "dtype": "float32"}
    assert "head.weight" not in tensors  # stored once, under its first name
    manifest = json.loads((root / "checkpoint_7" / "manifest.json").read_text())
    assert [(f["name"], f["size"], f["crc32"], f["status"]) for f in report["files"]] == [
        (f["name"], f["size"], f["crc32"], "ok") for f in manifest["files"]]


def test_inspect_text_and_verify_of_a_good_root(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "inspect", str(root / "checkpoint_3"))
    assert code == 0
    for words in ("step: 3", "saved by 1 process(es)", "model (model): full",
                  "optimizer (optimizer)", "model.safetensors", "problems: none"):
        assert words in out, (words, out)
    code, out, _ = _run(capsys, "verify", str(root))
    assert code == 0
    assert out.splitlines() == [f"{root / 'checkpoint_7'}: OK", f"{root / 'checkpoint_3'}: OK"]


@pytest.mark.parametrize(("damage", "words"), [
    ("truncate", "(truncated)"),
    ("flip", "(corrupted)"),
    ("delete", "model.safetensors: missing"),
    ("garbage_json", "optimizer.json: CRC32"),
])
def test_verify_exits_1_and_lists_each_problem(
    root: Path, capsys: pytest.CaptureFixture[str], damage: str, words: str
) -> None:
    target = root / "checkpoint_3"
    file = target / ("optimizer.json" if damage == "garbage_json" else "model.safetensors")
    data = file.read_bytes()
    if damage == "truncate":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        file.write_bytes(data[:100] + bytes([data[100] ^ 0x10]) + data[101:])
    elif damage == "delete":
        file.unlink()
    else:
        file.write_bytes(data[:-1] + b"]")
    code, out, _ = _run(capsys, "verify", str(root))
    assert code == 1
    assert f"{root / 'checkpoint_7'}: OK" in out
    assert f"{target}: 1 problem(s)" in out and words in out, out
    code, out, _ = _run(capsys, "verify", str(target), "--json")
    result = json.loads(out)
    assert code == 1 and not result["ok"] and words in result["checkpoints"][0]["problems"][0]
    code, out, _ = _run(capsys, "inspect", str(target))
    assert code == 1 and words in out  # inspect shows the status too


def test_foreign_entries_are_listed_not_failed(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / "checkpoint_7" / "notes.txt").write_text("mine")
    code, out, _ = _run(capsys, "inspect", str(root / "checkpoint_7"))
    assert code == 0 and "notes.txt  (not in the manifest" in out
    assert _run(capsys, "verify", str(root / "checkpoint_7"))[0] == 0


def test_not_a_checkpoint_and_a_broken_manifest(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("x")
    for action in ("inspect", "verify"):
        code, _, err = _run(capsys, action, str(notes))
        assert code == 2 and "is not a checkpoint (it holds ['a.txt']" in err, err
        code, _, err = _run(capsys, action, str(tmp_path / "absent"))
        assert code == 2 and "it does not exist" in err, err
    (root / "checkpoint_7" / "manifest.json").write_text('{"format": "accel-checkpoint"')
    code, out, _ = _run(capsys, "verify", str(root))
    assert code == 1 and "manifest" in out and f"{root / 'checkpoint_3'}: OK" in out
    code, _, err = _run(capsys, "inspect", str(root / "checkpoint_7"))
    assert code == 2 and "is invalid" in err, err


def test_accelerate_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    acc = tmp_path / "acc"
    acc.mkdir()
    save_file({"w": torch.ones(2, 3)}, acc / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, acc / "optimizer.bin")
    (acc / "random_states_0.pkl").write_bytes(b"never opened")
    code, out, _ = _run(capsys, "inspect", str(acc), "--tensors", "--json")
    report = json.loads(out)
    assert code == 0 and report["format"] == "accelerate"
    assert report["objects"][0] == {"name": "model", "file": "model.safetensors",
                                    "tensors": [{"name": "w", "shape": [2, 3],
                                                 "dtype": "float32"}]}
    status = {f["name"]: f["status"] for f in report["files"]}
    assert status["random_states_0.pkl"].startswith("not opened")
    assert _run(capsys, "verify", str(acc))[0] == 0
    (acc / "model.safetensors").write_bytes((acc / "model.safetensors").read_bytes()[:-4])
    code, out, _ = _run(capsys, "verify", str(acc))
    assert code == 1 and "model.safetensors" in out


def _save_fsdp(path: str) -> None:
    with accel.distributed(strategy="fsdp"):
        st = accel.state()
        model = accel.prepare_model(toy())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        accel.backward(loss_of(model, tokens(0, st.rank, st.world_size)))
        optimizer.step()
        accel.save_state(path, model=model, optimizer=optimizer)


def _rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace a file and record its new size and CRC32 in the manifest (a crafted copy)."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry.update(size=len(data), crc32=zlib.crc32(data))
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow  # two processes
def test_fsdp_checkpoint_mesh_pieces_and_coverage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fsdp"
    run_distributed(_save_fsdp, str(path), world_size=2)
    code, out, _ = _run(capsys, "inspect", str(path), "--tensors", "--json")
    report = json.loads(out)
    assert code == 0 and report["world_size"] == 2 and report["ranks"] == [0, 1]
    assert report["mesh"] == {"world_size": 2, "dims": 1, "placement": "Shard(0)"}
    model = next(o for o in report["objects"] if o["name"] == "model")
    assert model["layout"] == "sharded over ranks [0, 1]"
    assert "model__shards_rank1.safetensors" in model["files"]
    embed = next(t for t in model["tensors"] if t["name"] == "embed.weight")
    assert embed == {"name": "embed.weight", "shape": [37, 13], "dtype": "float32",
                     "sharded": True}  # the global shape, not a rank's piece
    code, out, _ = _run(capsys, "inspect", str(path))
    assert "mesh: 1-D over 2 ranks, FSDP pieces Shard(0)" in out
    # a rank's piece list that no longer covers a tensor, with a matching manifest
    crafted = tmp_path / "crafted"
    shutil.copytree(path, crafted)
    body = json.loads((crafted / "model__shards_rank1.json").read_text())
    del body["extra"]["pieces"]["embed.weight"]
    _rewrite(crafted, "model__shards_rank1.json", json.dumps(body).encode())
    code, out, _ = _run(capsys, "verify", str(crafted))
    assert code == 1 and "pieces of 'embed.weight' hold" in out, out
    # pieces that overlap (rank 1's placed on rank 0's: as many values, some twice)
    body = json.loads((path / "model__shards_rank1.json").read_text())
    body["extra"]["pieces"]["embed.weight"]["offset"] = [0, 0]
    shutil.rmtree(crafted)
    shutil.copytree(path, crafted)
    _rewrite(crafted, "model__shards_rank1.json", json.dumps(body).encode())
    code, out, _ = _run(capsys, "verify", str(crafted))
    assert code == 1 and "pieces of 'embed.weight' overlap" in out, out
    # a global shape that is not a list of counts: a problem named, not a crash
    body = json.loads((path / "model.json").read_text())
    body["extra"]["sharded"]["embed.weight"]["shape"] = ["lots", 13]
    shutil.rmtree(crafted)
    shutil.copytree(path, crafted)
    _rewrite(crafted, "model.json", json.dumps(body).encode())
    code, out, _ = _run(capsys, "verify", str(crafted))
    assert code == 1 and "no valid global shape for 'embed.weight'" in out, out
    os.unlink(path / "optimizer__shards_rank0.safetensors")
    code, out, _ = _run(capsys, "verify", str(path))
    assert code == 1 and "optimizer__shards_rank0.safetensors: missing" in out


@pytest.mark.slow  # four processes
@pytest.mark.ci_extra
def test_a_pipelined_checkpoint_shows_the_pp_dim_and_each_stages_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests import pipeline_models as pm

    path = tmp_path / "pp2xfsdp2"
    run_distributed(pm.chain, 1, 0, str(path), None, "1F1B", world_size=4, timeout=120,
                    pp_size=2, dp_shard_size=2)
    code, out, _ = _run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == []
    assert report["mesh"]["sizes"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1,
                                       "tp": 1}
    model = next(o for o in report["objects"] if o["name"] == "model")
    assert model["pipeline"] == {"schedule": "1F1B",
                                 "stages": [["inp", "layers.0", "layers.1"],
                                            ["layers.2", "layers.3", "head"]],
                                 "ranks": [[0], [1]]}
    code, out, _ = _run(capsys, "inspect", str(path))
    assert "mesh: 5-D (pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1) over 4 ranks" in out
    assert ("pipeline: 1F1B, 2 stages over 2 pp ranks\n"
            "  pp rank 0, stage 0: inp, layers.0, layers.1\n"
            "  pp rank 1, stage 1: layers.2, layers.3, head\n") in out
    # an altered record (a stage number no stage has): a problem named, not a crash
    body = json.loads((path / "model.json").read_text())
    body["extra"]["pipeline"]["ranks"] = [[0], [7]]
    _rewrite(path, "model.json", json.dumps(body).encode())
    code, out, _ = _run(capsys, "verify", str(path))
    assert code == 1 and "model: the recorded pipeline" in out, out
    code, out, _ = _run(capsys, "inspect", str(path))
    assert "pipeline:" not in out.split("objects:")[0]
