"""Hostile checkpoint inputs, one process: each is refused with a CheckpointError, nothing changes.

* torch pickles (``accel.load``, ``pytorch_model.bin``, an Accelerate checkpoint's ``.bin``
  files): malformed pickles (which would raise raw ``IndexError`` / ``TypeError`` /
  ``LookupError`` / ``MemoryError``); calls ``weights_only=True`` allows that build gigabytes
  from a few bytes (``bytearray(2**31)``, ``_codecs.encode`` nested, ``set()`` of an expanded
  tensor view); files older than the zip format;
* meta / sparse tensors in a weights file or an optimizer state, refused before the model
  changes; cyclic, very deep or self-repeating optimizer state (``load_state_dict`` would run
  40 s into ``MemoryError`` after the model was restored);
* FSDP pieces that claim the global tensor twice over (uninitialised memory otherwise);
* optimizer parameter ids that match no state (a parameter's state silently dropped otherwise);
* structure tags of the wrong form, manifest names ending in a newline, numbered directories
  spelled with other digits, scratch copies of another user, files swapped between the check
  and the read.

Inputs that would hang or eat memory on a regression run in a child process bounded in time
(``subprocess`` timeout) and address space (``RLIMIT_AS``).
"""

from __future__ import annotations

import codecs
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel._files.format import write_safetensors
from accel._files.objects import plan_object
from accel._files.writer import write_files
from accel.errors import CheckpointError
from accel.weights import stream as _stream

# -- torch pickles ---------------------------------------------------------------------------


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    return b"X" + struct.pack("<I", len(value.encode())) + value.encode()


def _legacy(main: bytes) -> bytes:
    """A torch file in the format before zip: magic, protocol, system info, object, keys."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    info = {"protocol_version": 1001, "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 8}}
    head = b"".join(pickle.dumps(v, protocol=2) for v in (MAGIC_NUMBER, PROTOCOL_VERSION, info))
    return head + main + pickle.dumps([], protocol=2)


def _zipped(main: bytes) -> bytes:
    """A torch zip file whose ``data.pkl`` is ``main``."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", main)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return out.getvalue()


def _layouts(main: bytes) -> dict[str, bytes]:
    return {"legacy": _legacy(main), "bare": main, "zip": _zipped(main)}


_MALFORMED = {  # each raised a raw exception from accel.load before
    "stop on an empty stack": b"\x80\x02.",  # IndexError
    "a list as a dict key": b"\x80\x02}]K\x01s.",  # TypeError
    "a pair of nothing": b"\x80\x02\x86.",  # IndexError
    "an unknown codec": b"\x80\x02" + _global("_codecs", "encode") + _text("a") + _text("zzz")
    + b"\x86R.",  # LookupError
    "OrderedDict(5)": b"\x80\x02" + _global("collections", "OrderedDict") + b"K\x05\x85R.",
}


@pytest.mark.parametrize("what", list(_MALFORMED))
@pytest.mark.parametrize("layout", ["legacy", "bare", "zip"])
def test_malformed_torch_pickles_are_checkpoint_errors(
    tmp_path: Path, what: str, layout: str
) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(_layouts(_MALFORMED[what])[layout])
    with pytest.raises(CheckpointError):
        accel.load(path)
    folder = tmp_path / "weights"
    folder.mkdir()
    shutil.copy(path, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError):
        accel.load_checkpoint_in_model(nn.Linear(2, 2), folder)


class _SetOf:
    """Pickles as ``set(value)``: what ``weights_only=True`` runs when the file is loaded."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (set, (self.value,))


class _Encoded:
    """Pickles as ``_codecs.encode(inner, codec)``."""

    def __init__(self, inner: Any, codec: str) -> None:
        self.inner, self.codec = inner, codec

    def __reduce__(self) -> tuple[Any, ...]:
        return (codecs.encode, (self.inner, self.codec))


def _bombs(folder: Path) -> dict[str, Path]:
    """Small files whose loading would build gigabytes."""
    grow = _global("builtins", "bytearray") + b"J" + struct.pack("<i", 0x7FFFFFFF) + b"\x85R"
    floats = _global("torch", "FloatTensor") + b"J" + struct.pack("<i", 0x7FFFFFFF) + b"\x85R"
    huge_text = b"X" + struct.pack("<I", 0xFFFFFFF0) + b"abc"  # 4 GiB declared, 3 bytes there
    # a list of 65,536 ints, set() of it 20,000 times through the memo: 1.3e9 elements
    items = b"]q\x01(" + b"".join(b"J" + struct.pack("<i", i) for i in range(1 << 16)) + b"e"
    memo = b"\x80\x02]" + items + _global("builtins", "set") + b"q\x02("
    memo += b"h\x02h\x01\x85R" * 20_000 + b"e."
    hexed: Any = b"abcd"
    for _ in range(33):  # each level doubles: 2**35 bytes
        hexed = _Encoded(hexed, "hex")
    files = {
        "legacy bytearray(2**31)": _legacy(b"\x80\x02" + grow + b"."),
        "zip bytearray(2**31)": _zipped(b"\x80\x02" + grow + b"."),
        "legacy FloatTensor(2**31)": _legacy(b"\x80\x02" + floats + b"."),
        "bare 4 GiB string": b"\x80\x02" + huge_text + b".",
        "legacy 4 GiB string": _legacy(b"\x80\x02" + huge_text + b"."),
        "zip set() of one string 20,000 times": _zipped(memo),
        "legacy set() of one string 20,000 times": _legacy(memo),
    }
    out = {}
    for name, data in files.items():
        out[name] = folder / f"{len(out)}.pt"
        out[name].write_bytes(data)
    for name, obj in {
        "zip hex codec nested 33 times": hexed,
        "zip set() of a 2**31 expanded view": _SetOf(torch.zeros(1).expand(2**31)),
    }.items():
        out[name] = folder / f"{len(out)}.pt"
        torch.save(obj, out[name])
    return out


_BOUNDED = textwrap.dedent(
    """
    import json, resource, sys, time, warnings
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    import torch
    from torch import nn
    import accel
    warnings.simplefilter("ignore")
    for name, (op, path) in json.loads(sys.argv[1]).items():
        start = time.monotonic()
        try:
            if op == "load":
                accel.load(path)
            elif op == "weights":
                accel.load_checkpoint_in_model(nn.Linear(4, 4), path)
            elif op == "accelerate":
                torch.manual_seed(0)
                model = nn.Linear(4, 4)
                before = model.weight.detach().clone()
                opt = torch.optim.AdamW(model.parameters())
                try:
                    accel.load_state(path, model=model, optimizer=opt)
                finally:
                    if not torch.equal(model.weight, before):
                        print(json.dumps({name: ["CHANGED", "model changed", 0]}), flush=True)
            outcome = ["OK", "", 0]
        except Exception as exc:
            outcome = [type(exc).__name__, str(exc), 0]
        outcome[2] = time.monotonic() - start
        print(json.dumps({name: outcome}), flush=True)
    """
)


def _bounded(cases: dict[str, tuple[str, str]], timeout: float = 120) -> dict[str, Any]:
    """Run each ``name: (op, path)`` in one child limited to 3 GiB of address space and
    ``timeout`` seconds; each result is ``[exception type, message, seconds]``."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _BOUNDED, json.dumps(cases)],
            capture_output=True, text=True, timeout=timeout, env=env, check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"a hostile file hung the reader for {timeout}s; finished: {out}")
    results: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            for name, outcome in json.loads(line).items():
                if results.get(name, [""])[0] != "CHANGED":
                    results[name] = outcome
    assert set(results) == set(cases), (done.returncode, done.stdout, done.stderr[-3000:])
    return results


@pytest.mark.slow
@pytest.mark.ci_extra
def test_torch_pickles_that_would_build_gigabytes_are_refused_before_torch_reads_them(
    tmp_path: Path,
) -> None:
    files = _bombs(tmp_path)
    cases: dict[str, tuple[str, str]] = {}
    for name, path in files.items():
        cases[f"load: {name}"] = ("load", os.fspath(path))
        folder = tmp_path / f"weights{len(cases)}"
        folder.mkdir()
        shutil.copy(path, folder / "pytorch_model.bin")
        cases[f"weights: {name}"] = ("weights", os.fspath(folder))
    results = _bounded(cases)
    for name, (kind, message, _) in results.items():
        assert kind == "CheckpointError", (name, kind, message)
        assert "is not a torch file accel reads" in message, (name, message)


def test_a_legitimate_torch_file_still_loads_in_both_formats(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": b"bytes", "n": {1, 2}, "s": "text",
             "shared": (torch.ones(2),) * 2}
    for zipped in (True, False):
        path = tmp_path / f"state{zipped}.pt"
        torch.save(state, path, _use_new_zipfile_serialization=zipped)
        loaded = accel.load(path)
        assert torch.equal(loaded["w"], state["w"]) and loaded["b"] == b"bytes"
        assert loaded["n"] == {1, 2} and loaded["shared"][0] is loaded["shared"][1]


# -- tensors no weight takes -----------------------------------------------------------------


def _weights_dir(tmp_path: Path, weight: torch.Tensor, zipped: bool = True) -> Path:
    folder = tmp_path / "weights"
    folder.mkdir(exist_ok=True)
    state = {"weight": weight, "bias": torch.zeros(4)}
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=zipped)
    return folder


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        (torch.empty(4, 4, device="meta"), "a meta tensor"),
        (torch.eye(4).to_sparse(), "layout torch.sparse_coo"),
        (torch.eye(4, dtype=torch.complex64), "complex"),
    ],
    ids=["meta", "sparse", "complex"],
)
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_weights_no_parameter_takes_are_refused_before_the_model_changes(
    tmp_path: Path, weight: torch.Tensor, match: str, zipped: bool
) -> None:
    folder = _weights_dir(tmp_path, weight, zipped)
    model = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        accel.load_checkpoint_in_model(model, folder)
    with accel.init_empty_weights():
        empty = nn.Linear(4, 4)
    with pytest.raises(CheckpointError, match=match):
        accel.load_checkpoint_and_dispatch(empty, folder, device_map={"": "cpu"})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_file_swapped_between_the_check_and_the_read_is_refused(tmp_path: Path) -> None:
    """F32 weights checked by plan_load, then the file replaced by I32 ones of the same
    shape: the read notices (it loaded the integers' bits as ~1e9 floats before)."""
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"weight": torch.ones(4, 4), "bias": torch.ones(4)})
    model = nn.Linear(4, 4)
    plan = _stream.plan_load(model, [path], placer=_stream.in_place, dtype=None)
    write_safetensors(path, {"weight": torch.ones(4, 4, dtype=torch.int32),
                             "bias": torch.ones(4)})
    with pytest.raises(CheckpointError, match="changed while it was being loaded"):
        _stream.stream(plan)


def test_a_mapped_source_of_integer_bits_never_feeds_a_float_weight(tmp_path: Path) -> None:
    from accel.big_model.dispatch import dispatch_with_sources
    from accel.big_model.offload import TensorSource

    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"weight": torch.ones(4, 4, dtype=torch.int32)})
    with accel.init_empty_weights():
        model = nn.Linear(4, 4, bias=False)
    cpu = torch.device("cpu")
    with pytest.raises(CheckpointError, match="read as other numbers"):
        dispatch_with_sources(model, {"": cpu}, {"weight": TensorSource(path, "weight")})


# -- Accelerate checkpoints: optimizer states accel must walk --------------------------------


def _accelerate_dir(tmp_path: Path, change: Any) -> tuple[Path, nn.Linear, Any]:
    """An Accelerate-layout checkpoint of a Linear and its AdamW, the optimizer state
    changed by ``change(state_dict)``; returns it with a fresh model and optimizer."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    folder = tmp_path / "acc"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {k: v + 1 for k, v in
                                                      model.state_dict().items()})
    state = opt.state_dict()
    change(state)
    torch.save(state, folder / "optimizer.bin")
    torch.manual_seed(1)
    fresh = nn.Linear(4, 4)
    return folder, fresh, torch.optim.AdamW(fresh.parameters())


def _cycle(state: dict[str, Any]) -> None:
    loop: list[Any] = []
    loop.append(loop)
    state["state"][0]["junk"] = loop


def _deep(state: dict[str, Any]) -> None:
    nested: Any = 1
    for _ in range(300):
        nested = [nested]
    state["state"][0]["junk"] = nested


def _meta(state: dict[str, Any]) -> None:
    state["state"][0]["exp_avg"] = torch.empty(4, 4, device="meta")


def _meta_step(state: dict[str, Any]) -> None:
    state["state"][0]["step"] = torch.empty((), device="meta")


def _stray(state: dict[str, Any]) -> None:
    state["param_groups"][0]["params"] = [7, 1]  # state 0 would be dropped


def _twice(state: dict[str, Any]) -> None:
    state["param_groups"][0]["params"] = [1, 1]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_cycle, "holds itself"),
        (_deep, "nests more than 128 levels"),
        (_meta, "a meta tensor"),
        (_meta_step, "a meta tensor"),
        (_stray, "that none of its parameter groups names"),
        (_twice, "each must be a distinct number"),
    ],
    ids=["cycle", "deep", "meta", "meta-step", "stray-state", "duplicate-ids"],
)
def test_accelerate_optimizer_states_accel_cannot_take_change_nothing(
    tmp_path: Path, change: Any, match: str
) -> None:
    folder, model, opt = _accelerate_dir(tmp_path, change)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=match):
            accel.load_state(folder, model=model, optimizer=opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state


@pytest.mark.slow  # a fresh bounded interpreter and 2**45-fold sharing: 5-12 s when loaded
@pytest.mark.ci_extra
def test_a_self_repeating_optimizer_state_is_refused_quickly(tmp_path: Path) -> None:
    """45 levels of ``x = [x, x]``: torch's load_state_dict walks 2**45 values (it ran 40 s
    into MemoryError, after the model was restored)."""

    def repeat(state: dict[str, Any]) -> None:
        shared: Any = [1]
        for _ in range(45):
            shared = [shared, shared]
        state["state"][0]["junk"] = shared

    folder, _, _ = _accelerate_dir(tmp_path, repeat)
    (kind, message, seconds), = _bounded({"dag": ("accelerate", os.fspath(folder))},
                                         timeout=60).values()
    assert kind == "CheckpointError" and "repeats shared containers" in message, message
    assert seconds < 20


# -- accel checkpoints -----------------------------------------------------------------------


def _checkpoint(folder: Path, objects: dict[str, tuple[Any, dict[str, Any]]],
                world_size: int = 2) -> Path:
    """A checkpoint as save_state writes it, of ``{name: (state, extra)}`` (plus pieces
    files named like objects); saved by ``world_size`` ranks (so no RNG file is needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [r for name, (state, extra) in objects.items()
               for r in write_files(plan_object(folder, name, state, extra))]
    manifest = {
        "format": "accel-checkpoint", "version": 1, "step": None, "world_size": world_size,
        "objects": sorted(n for n in objects if "__shards_" not in n),
        "files": [{"name": r.name, "size": r.size, "crc32": r.crc32, "rank": 0}
                  for r in records],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _sharded(folder: Path, pieces: list[dict[str, Any]]) -> Path:
    """A Linear(4, 4)'s weight as FSDP pieces: ``pieces[r]`` is rank r's piece list."""
    full = torch.arange(16.0).reshape(4, 4)
    objects: dict[str, tuple[Any, dict[str, Any]]] = {"model": (
        {"weight": {"__accel_shard__": "weight"}, "bias": torch.zeros(4)},
        {"sharded": {"weight": {"shape": [4, 4], "dtype": "float32"}}},
    )}
    for rank, where in enumerate(pieces):
        tensors = {}
        for key in where:
            tensors[key] = full[2 * rank : 2 * rank + 2].clone()
        objects[f"model__shards_rank{rank}"] = (tensors, {"pieces": where})
    return _checkpoint(folder, objects)


def _load_sharded(folder: Path) -> nn.Linear:
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accel.load_state(folder, model=model)
    return model


def test_honest_pieces_reassemble(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "ok", [{"weight": {"offset": [0, 0], "shape": [2, 4]}},
                                        {"weight": {"offset": [2, 0], "shape": [2, 4]}}])
    model = _load_sharded(folder)
    assert torch.equal(model.weight.detach(), torch.arange(16.0).reshape(4, 4))


@pytest.mark.parametrize(
    ("rank1", "match"),
    [
        ({"offset": [0, 0], "shape": [2, 4]}, "overlap"),  # rows 0-1 twice, rows 2-3 never
        ({"offset": [3, 0], "shape": [2, 4]}, "outside its global shape"),
        ({"offset": [2.0, 0], "shape": [2, 4]}, "places its piece"),
        ({"offset": ["2", 0], "shape": [2, 4]}, "places its piece"),
        ({"offset": [True, 0], "shape": [2, 4]}, "places its piece"),
        ({"offset": [2, 0], "shape": [-2, 4]}, "places its piece"),
        ({"offset": [2], "shape": [2]}, "outside its global shape"),
        ([2, 0], "places its piece"),
    ],
    ids=["overlap", "outside", "float", "string", "bool", "negative", "rank", "list"],
)
def test_crafted_pieces_are_refused(tmp_path: Path, rank1: Any, match: str) -> None:
    folder = _sharded(tmp_path / "bad", [{"weight": {"offset": [0, 0], "shape": [2, 4]}},
                                         {"weight": rank1}])
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=match):
            accel.load_state(folder, model=model)
    assert torch.equal(model.weight.detach(), before)


def test_a_huge_global_shape_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "huge", {"model": (
        {"weight": {"__accel_shard__": "weight"}, "bias": torch.zeros(4)},
        {"sharded": {"weight": {"shape": [1 << 20, 1 << 20], "dtype": "float32"}}},
    )})
    with pytest.raises(CheckpointError, match=r"cover 0 of the 1099511627776 values"):
        _load_sharded(folder)


def _saved(tmp_path: Path) -> tuple[Path, nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return accel.save_state(tmp_path / "ckpt", model=model, optimizer=opt), model, opt


def _rewrite(ckpt: Path, name: str, change: Any) -> None:
    """Change the JSON entry ``name`` of ``ckpt`` (the manifest agreeing: size, CRC)."""
    body = json.loads((ckpt / name).read_bytes())
    change(body)
    data = json.dumps(body).encode()
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _set_betas(value: Any) -> Any:
    return lambda body: body["state"]["param_groups"][0].__setitem__("betas", value)


def _set_state(value: Any) -> Any:
    return lambda body: body["state"].__setitem__("state", value)


@pytest.mark.parametrize(
    "change",
    [
        _set_betas({"__tuple__": 5}),
        _set_state({"__dict__": [[1, 2, 3]]}),
        _set_state({"__dict__": [[[1], 2]]}),
        _set_state({"__dict__": 5}),
        _set_betas({"__float__": "abc"}),
        _set_betas({"__float__": [1]}),
        lambda body: body["state"]["state"]["__dict__"][0][1].__setitem__(
            "exp_avg", {"__tensor__": [1]}),
    ],
    ids=["tuple-int", "dict-triple", "dict-list-key", "dict-int", "float-text", "float-list",
         "tensor-list"],
)
def test_structure_tags_accel_never_writes_are_named(tmp_path: Path, change: Any) -> None:
    ckpt, model, opt = _saved(tmp_path)
    _rewrite(ckpt, "optimizer.json", change)
    with pytest.raises(CheckpointError, match="which accel never writes"):
        accel.load_state(ckpt, model=model, optimizer=opt)


@pytest.mark.parametrize("ids", [[10**30, 1], [0, 0], ["a", "b"]])
def test_optimizer_ids_that_lose_state_are_refused(tmp_path: Path, ids: list[Any]) -> None:
    ckpt, _, _ = _saved(tmp_path)
    _rewrite(ckpt, "optimizer.json",
             lambda body: body["state"]["param_groups"][0].__setitem__("params", ids))
    torch.manual_seed(3)
    fresh = nn.Linear(4, 4)
    before = fresh.weight.detach().clone()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(CheckpointError, match="parameter"):
        accel.load_state(ckpt, model=fresh, optimizer=fresh_opt)
    assert torch.equal(fresh.weight.detach(), before) and not fresh_opt.state


def test_a_manifest_name_ending_in_a_newline_is_refused(tmp_path: Path) -> None:
    ckpt, model, _ = _saved(tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    manifest["files"][0]["name"] += "\n"
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        accel.load_state(ckpt, model=model)


@pytest.mark.parametrize("name", ["checkpoint_\u0669", "checkpoint_9\n", "checkpoint_\uff19"])
def test_numbered_names_in_other_digits_are_not_checkpoints(tmp_path: Path, name: str) -> None:
    """Only ASCII digits, and nothing after them, number a checkpoint (``int()`` reads the
    Arabic-Indic ``9`` too, so such a name shadowed or outranked a real one)."""
    root = tmp_path / "root"
    real = accel.save_state(root, step=1, model=nn.Linear(4, 4))
    shutil.copytree(real, root / name)
    assert accel.latest_checkpoint(root) == real
    assert accel.save_state(root, step=2, total_limit=1, model=nn.Linear(4, 4)).exists()
    assert (root / name).exists()  # neither counted nor removed by the rotation


# -- scratch copies of another user ----------------------------------------------------------

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to make another user's files",
)


def _planted(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
        os.chown(path / name, 4242, 4242)
    os.chown(path, 4242, 4242)
    return path


@needs_root
def test_another_users_old_copy_is_never_taken_for_a_checkpoint(tmp_path: Path) -> None:
    elsewhere = accel.save_state(tmp_path / "elsewhere", model=nn.Linear(4, 4))
    planted = tmp_path / ".ckpt.old-0123456789ab"
    shutil.copytree(elsewhere, planted)
    for entry in [planted, *planted.iterdir()]:
        os.chown(entry, 4242, 4242)
    assert accel.load_state(tmp_path / "ckpt", missing_ok=True, model=nn.Linear(4, 4)) is None
    accel.save_state(tmp_path / "ckpt", model=nn.Linear(4, 4))
    assert planted.is_dir() and (planted / "manifest.json").exists()  # left alone


@needs_root
def test_save_model_never_moves_another_users_files_into_the_model_directory(
    tmp_path: Path,
) -> None:
    out = accel.save_model(nn.Linear(4, 4), tmp_path / "model")
    planted = _planted(tmp_path / ".model.tmp-0123456789ab", {"modeling_evil.py": b"import os"})
    accel.save_model(nn.Linear(4, 4), out)
    assert not (out / "modeling_evil.py").exists()
    assert (planted / "modeling_evil.py").exists()


# -- values restored at apply time ---------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda body: body["state"].__setitem__("optimizer", 5), "own 'optimizer'"),
        (lambda body: body["state"].__setitem__("step", 1), "own 'step'"),
        (lambda body: body["state"].__setitem__("__class__", "x"), "own '__class__'"),
    ],
    ids=["optimizer", "step-method", "dunder"],
)
def test_scheduler_keys_that_would_replace_its_own_attributes_are_refused(
    tmp_path: Path, change: Any, match: str
) -> None:
    """A scheduler's load_state_dict is ``__dict__.update(state)``: ``"optimizer": 5`` made
    the next ``scheduler.step()`` fail, ``"step": 1`` replaced the method."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    ckpt = accel.save_state(tmp_path / "ckpt", model=model, scheduler=sched)
    _rewrite(ckpt, "scheduler.json", change)
    with pytest.raises(CheckpointError, match=match):
        accel.load_state(ckpt, model=model, scheduler=sched)
    assert sched.optimizer is opt
    sched.step()


def test_lr_lambdas_of_another_length_are_refused(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)
    ckpt = accel.save_state(tmp_path / "ckpt", scheduler=sched)
    _rewrite(ckpt, "scheduler.json",
             lambda body: body["state"].__setitem__("lr_lambdas", [None, None, None]))
    with pytest.raises(CheckpointError, match="a list of 1 function states"):
        accel.load_state(ckpt, scheduler=sched)


def _sampler_checkpoint(folder: Path, epoch: Any) -> Path:
    data_loader = pytest.importorskip("accelerate.data_loader")
    sampler = data_loader.SeedableRandomSampler(list(range(8)))
    sampler.epoch = epoch
    folder.mkdir()
    torch.save(sampler, folder / "sampler.bin")
    write_safetensors(folder / "model.safetensors", nn.Linear(4, 4).state_dict())
    return folder


@pytest.mark.parametrize("epoch", [True, -5, 2.5])
def test_a_sampler_epoch_no_loader_takes_is_refused_before_anything_changes(
    tmp_path: Path, epoch: Any
) -> None:
    from torch.utils.data import DataLoader

    folder = _sampler_checkpoint(tmp_path / "acc", epoch)
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    with accel.distributed():
        loader = accel.prepare_data_loader(DataLoader(list(range(16)), batch_size=2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointError, match="integer epoch >= 0"):
                accel.load_state(folder, model=model, train_loader=loader)
    assert torch.equal(model.weight.detach(), before)


# -- headers and files that state no size ----------------------------------------------------


def test_a_header_dtype_that_is_no_name_is_a_checkpoint_error(tmp_path: Path) -> None:
    header = json.dumps({"weight": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}})
    data = header.encode() + b" " * (-len(header) % 8)
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(data)) + data + bytes(16))
    with pytest.raises(CheckpointError, match="unknown dtype"):
        accel.load(path)
    with pytest.raises(CheckpointError, match="unknown dtype"):
        accel.load_checkpoint_in_model(nn.Linear(4, 4), path)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_a_torch_file_that_states_no_size_is_refused(tmp_path: Path) -> None:
    """A link to a /proc file (size 0, content on read) was read by torch unchecked."""
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "pytorch_model.bin").symlink_to("/proc/self/environ")
    with pytest.raises(CheckpointError, match="states no size"):
        accel.load_checkpoint_in_model(nn.Linear(4, 4), folder)


def test_a_grad_scaler_state_lacking_a_key_is_refused_before_anything_changes() -> None:
    """GradScaler.load_state_dict reads every key (KeyError after the other objects were
    restored); the check that runs before any change now names the missing one."""
    from accel._files.values import check_values

    scaler = torch.amp.GradScaler("cpu")
    state = scaler.state_dict()
    check_values("grad_scaler", scaler, state)
    del state["scale"]
    with pytest.raises(CheckpointError, match="'scale'"):
        check_values("grad_scaler", scaler, state)


def _zip_of_many(path: Path, count: int) -> None:
    """A zip64 archive of ``archive/data.pkl`` and ``count`` empty members, written by hand."""
    members = [("archive/data.pkl", pickle.dumps({}, protocol=2))]
    members += [(f"archive/m{i}", b"") for i in range(count)]
    body, directory = bytearray(), bytearray()
    for name, data in members:
        raw, crc, offset = name.encode(), zlib.crc32(data), len(body)
        body += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, len(data),
                            len(data), len(raw), 0) + raw + data
        directory += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21,
                                 crc, len(data), len(data), len(raw), 0, 0, 0, 0, 0, offset) + raw
    start, total = len(body), len(members)
    body += directory
    record = len(body)
    body += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, total, total,
                        len(directory), start)
    body += struct.pack("<4sIQI", b"PK\x06\x07", 0, record, 1)
    body += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                        0xFFFFFFFF, 0)
    path.write_bytes(bytes(body))


def test_a_torch_zip_of_a_million_members_is_refused_from_its_end_record(tmp_path: Path) -> None:
    """Reading a directory of 10**6 members took the check ~50 s and ~1 GB; the end record
    says how many there are before any is read."""
    from accel._files.torch_zip import MAX_MEMBERS

    path = tmp_path / "many.pt"
    _zip_of_many(path, MAX_MEMBERS + 1)
    with pytest.raises(CheckpointError, match=f"lists {MAX_MEMBERS + 2} members"):
        accel.load(path)


@pytest.mark.parametrize("extra", [{"name": "model.json"}, {"name": "manifest.json"}])
def test_a_manifest_listing_a_file_twice_is_refused(tmp_path: Path, extra: dict[str, Any]) -> None:
    ckpt, model, _ = _saved(tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    manifest["files"].append({"size": 5, "crc32": 0, "rank": 0, **extra})
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="listed twice"):
        accel.load_state(ckpt, model=model)


def test_many_refused_checkpoints_give_one_warning(tmp_path: Path) -> None:
    """latest_checkpoint and the rotation read each manifest once and warn once, naming ten
    and counting the rest (100,000 planted manifests gave 100,000 warnings)."""
    root = tmp_path / "root"
    good = accel.save_state(root, step=1, model=nn.Linear(4, 4))
    for step in range(10, 40):
        (root / f"checkpoint_{step}").mkdir()
        (root / f"checkpoint_{step}" / "manifest.json").write_text("{broken")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert accel.latest_checkpoint(root) == good
        accel.save_state(root, step=50, total_limit=1, model=nn.Linear(4, 4))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert all("(and 20 more)" in m for m in messages), messages
    assert not good.exists() and (root / "checkpoint_10").exists()
