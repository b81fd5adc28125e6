"""`accel merge-weights`: training checkpoints to the weights layout `save_model` writes.

A 2-process FSDP `save_state` of a transformers GPT-2 is merged and loaded with
`from_pretrained`, which must give the trained model's logits; the merge's peak memory is
measured (anonymous resident memory, sampled) against the size of the model. Single-process
checkpoints, hand-made Accelerate directories and broken inputs run fast. The CLI runs in this
process (`main([...])`).
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import accel
from accel.cli.main import main
from accel.testing import run_distributed, run_script
from tests.tied_models import gpt2, loss_of, tokens, toy

pytest.importorskip("transformers")
# what the worker processes import (GPT-2; Accelerate for its own save_state), imported once
# by the warm server instead (conftest.py)
pytestmark = pytest.mark.preload("transformers", "transformers.models.gpt2.modeling_gpt2",
                                 "accelerate")

BIG_LAYERS, BIG_IN, BIG_OUT = 32, 512, 256  # 32 tensors of 512 KiB: 16 MiB of weights


def _big() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(*(nn.Linear(BIG_IN, BIG_OUT, bias=False) for _ in range(BIG_LAYERS)))


def _train_and_save(root: str) -> dict[str, Any] | None:
    """Rank work: GPT-2 with FSDP, one AdamW step, save_state; a 16 MiB model saved too."""
    with accel.distributed(strategy="fsdp"):
        st = accel.state()
        model = accel.prepare_model(gpt2())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        accel.backward(loss_of(model, tokens(0, st.rank, st.world_size)))
        optimizer.step()
        optimizer.zero_grad()
        accel.save_state(os.path.join(root, "gpt2"), step=1, model=model, optimizer=optimizer)
        with torch.no_grad():
            logits = model(tokens(5)).logits.float()
        big = accel.prepare_model(_big())
        accel.save_state(os.path.join(root, "big"), model=big)
        big_weights = accel.get_state_dict(big)
    if st.rank:
        return None
    return {"logits": logits, "big": big_weights}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp")
    result = run_distributed(_train_and_save, str(root), world_size=2)[0]
    assert result is not None
    model: Any = gpt2()
    model.config.save_pretrained(root / "config")
    return {"root": root, **result}


def _merge(*args: str) -> int:
    return main(["merge-weights", *args])


@pytest.mark.slow  # two processes
def test_fsdp_checkpoint_merged_loads_with_from_pretrained(
    fsdp: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers

    out = tmp_path / "export"
    config = str(fsdp["root"] / "config")
    assert _merge(str(fsdp["root"] / "gpt2"), str(out), "--config", config) == 0
    assert "matched its manifest (size, CRC32)" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    stored = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied: written once, under the stored name
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        logits = model(tokens(5)).logits
    torch.testing.assert_close(logits, fsdp["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two processes (shared fixture)
def test_shards_index_and_dtype(fsdp: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "shards"
    assert _merge(str(fsdp["root"] / "gpt2" / "checkpoint_1"), str(out),
                  "--max-shard-size", "6KB", "--dtype", "bf16") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    tensors = {k: v for f in files for k, v in load_file(out / f).items()}
    assert set(tensors) == set(index["weight_map"])
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    reference = gpt2()
    accel.load_checkpoint_in_model(reference, out, dtype=torch.bfloat16)
    with torch.no_grad():
        assert reference(tokens(5)).logits.dtype == torch.bfloat16


class _PeakAnon:
    """The largest anonymous resident memory (RssAnon) of this process, sampled every 0.5 ms."""

    def __init__(self) -> None:
        self.peak = self.base = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _now() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        pytest.skip("no RssAnon in /proc/self/status")

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> _PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())


def _peak_torch_bytes(run: Any) -> int:
    """The most bytes torch had allocated at once on the CPU while ``run()`` ran (profiler
    allocation and free events, in time order); memory-mapped checkpoint files not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert run() == 0
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                    if e.self_cpu_memory_usage)
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


@pytest.mark.slow  # two processes (shared fixture)
def test_peak_memory_is_one_tensor_not_the_model(fsdp: dict[str, Any], tmp_path: Path) -> None:
    model_bytes = BIG_LAYERS * BIG_IN * BIG_OUT * 4
    tensor_bytes = BIG_IN * BIG_OUT * 4
    out, again = tmp_path / "big", tmp_path / "again"
    source = str(fsdp["root"] / "big")
    # each tensor is assembled from both ranks' pieces into one new tensor, written, freed
    peak = _peak_torch_bytes(lambda: _merge(source, str(out), "--max-shard-size", "1MiB"))
    assert tensor_bytes <= peak < 2 * tensor_bytes, peak  # measured: exactly one tensor
    # the process as a whole (sampled): malloc keeps freed blocks for reuse (4 to 6 MiB
    # measured here, depending on the heap earlier tests left), below the 16 MiB model
    with _PeakAnon() as memory:
        assert _merge(source, str(again), "--max-shard-size", "1MiB") == 0
    grown = memory.peak - memory.base
    assert grown < model_bytes / 2, f"merge grew anonymous memory by {grown} bytes"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == BIG_LAYERS // 2  # 2 tensors per 1 MiB
    merged = {k: v for f in set(index["weight_map"].values()) for k, v in
              load_file(out / f).items()}
    assert merged.keys() == fsdp["big"].keys()
    for key, value in fsdp["big"].items():
        assert torch.equal(merged[key], value), key
    assert index["metadata"]["total_size"] == model_bytes


@pytest.fixture
def single(tmp_path: Path) -> tuple[Path, Any]:
    model = toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accel.backward(loss_of(model, tokens(0)))
    optimizer.step()
    path = accel.save_state(tmp_path / "ckpt", step=7, model=model, optimizer=optimizer)
    return path, model


def _no_leftovers(parent: Path, name: str) -> None:
    assert not [n for n in os.listdir(parent) if n == name or n.startswith(f".{name}.")]


def test_one_process_checkpoint_from_its_root(
    single: tuple[Path, Any], tmp_path: Path
) -> None:
    path, model = single
    assert _merge(str(path.parent), str(tmp_path / "out" / "deep")) == 0
    stored = load_file(tmp_path / "out" / "deep" / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied
    assert stored.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(stored[key], value), key
    fresh: Any = toy(seed=9)
    accel.load_checkpoint_in_model(fresh, tmp_path / "out" / "deep", strict=True)
    assert torch.equal(fresh.head.weight, model.head.weight)


@pytest.mark.parametrize(("damage", "words"), [
    ("truncate", "truncated"),
    ("flip", "CRC32"),
    ("delete", "missing"),
    ("relabel", "declares other dtypes than its structure file recorded"),
])
def test_a_damaged_checkpoint_writes_nothing(
    single: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    damage: str, words: str,
) -> None:
    path, _ = single
    file = path / "model.safetensors"
    data = file.read_bytes()
    if damage == "truncate":
        file.write_bytes(data[:-10])
    elif damage == "flip":
        file.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "relabel":  # a header's F32 made I32, the manifest's CRC32 made to match
        relabelled = data.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1)
        assert relabelled != data
        file.write_bytes(relabelled)
        manifest = json.loads((path / "manifest.json").read_text())
        for entry in manifest["files"]:
            if entry["name"] == "model.safetensors":
                entry["crc32"] = zlib.crc32(relabelled)
        (path / "manifest.json").write_text(json.dumps(manifest))
    else:
        file.unlink()
    assert _merge(str(path), str(tmp_path / "out" / "weights")) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel merge-weights: error: ") and words in err, err
    assert not (tmp_path / "out").exists()  # not even the parent it created


def test_not_a_checkpoint_and_bad_arguments_are_clear_errors(
    single: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = single
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("hello")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    cases = [
        ([str(notes), str(tmp_path / "o1")], "is not a checkpoint (it holds ['a.txt']"),
        ([str(tmp_path / "absent"), str(tmp_path / "o1")], "it does not exist"),
        ([str(path), str(taken)], "already exists and is not an empty directory"),
        ([str(path), str(path / "inside")], "is inside the checkpoint"),
        ([str(path), str(tmp_path / "o1"), "--object", "optimizer"], "is not a model"),
        ([str(path), str(tmp_path / "o1"), "--object", "ema"], "holds no object 'ema'"),
        ([str(path), str(tmp_path / "o1"), "--max-shard-size", "huge"], "is not a size"),
        ([str(path), str(tmp_path / "o1"), "--dtype", "int4"], "give fp32, bf16 or fp16"),
        ([str(path), str(tmp_path / "o1"), "--config", str(notes)], "cannot be read"),
    ]
    for args, words in cases:
        assert _merge(*args) == 2, args
        err = capsys.readouterr().err
        assert words in err, (args, err)
    assert (taken / "x").read_text() == "mine" and sorted(os.listdir(taken)) == ["x"]
    _no_leftovers(tmp_path, "o1")


def test_accelerate_save_state_directory(tmp_path: Path) -> None:
    """Accelerate's layout, by hand: a DDP model's keys keep the `module.` prefix."""
    model: Any = toy(tie=False)
    acc = tmp_path / "acc" / "checkpoint_3"
    acc.mkdir(parents=True)
    save_file({f"module.{k}": v.contiguous() for k, v in model.state_dict().items()},
              acc / "model.safetensors", metadata={"format": "pt"})
    torch.save({"state": {}, "param_groups": []}, acc / "optimizer.bin")
    (acc / "random_states_0.pkl").write_bytes(b"never opened")
    assert _merge(str(tmp_path / "acc"), str(tmp_path / "out")) == 0
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert stored.keys() == model.state_dict().keys()
    assert torch.equal(stored["head.weight"], model.head.weight)


def test_accelerate_fsdp_sharded_directory_is_refused_with_the_way_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    acc = tmp_path / "acc"
    (acc / "pytorch_model_fsdp_0").mkdir(parents=True)
    torch.save({"state": {}, "param_groups": []}, acc / "optimizer.bin")
    assert _merge(str(acc), str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "pytorch_model_fsdp_0" in err and "FULL_STATE_DICT" in err, err
    assert not (tmp_path / "out").exists()


_ACCELERATE_SCRIPT = """
import sys, torch
from accelerate import Accelerator
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
accelerator = Accelerator(cpu=True)
model, opt = accelerator.prepare(model, opt)
accelerator.save_state(sys.argv[1])
torch.save(accelerator.unwrap_model(model).state_dict(), sys.argv[2])
"""


@pytest.fixture
def accelerate_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """What Accelerate's own ``save_state`` writes, from ``python script.py`` (forked from
    the warm workers: ``run_script(launch=False)``)."""
    pytest.importorskip("accelerate")
    target, weights = tmp_path / "acc_ckpt", tmp_path / "weights.pt"
    script = tmp_path / "accelerate_save.py"
    script.write_text(_ACCELERATE_SCRIPT)
    env: dict[str, str | None] = {k: None for k in os.environ
                                  if k.startswith(("ACCEL", "RANK", "WORLD"))}
    run_script(script, str(target), str(weights), world_size=1, launch=False, env=env,
               cwd=tmp_path, timeout=240)  # raises, quoting the traceback, if it fails
    return target, torch.load(weights, weights_only=True)


@pytest.mark.slow  # runs a script with Accelerate
def test_a_real_accelerate_save_state(
    accelerate_dir: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    source, weights = accelerate_dir
    assert _merge(str(source), str(tmp_path / "out"), "--dtype", "fp16") == 0
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert stored.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(stored[key], value.half()), key


def test_choosing_among_several_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    net, ema = toy(seed=1), toy(seed=2)
    path = accel.save_state(tmp_path / "two", net=net, ema=ema)
    assert _merge(str(path), str(tmp_path / "o1")) == 2
    err = capsys.readouterr().err
    assert "holds several models ['ema', 'net']; choose one with --object" in err, err
    assert _merge(str(path), str(tmp_path / "o2"), "--object", "ema") == 0
    stored = load_file(tmp_path / "o2" / "model.safetensors")
    assert torch.equal(stored["embed.weight"], ema.embed.weight)
