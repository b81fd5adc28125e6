"""Values a checkpoint restores are checked against what the live objects hold, before any of
them changes.

Each test crafts a checkpoint as an attacker (or a corrupting disk) could: it edits a
structure file or a safetensors header and rewrites the manifest's size and CRC32 to match,
so that only the new checks stand between the file and the objects.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import accel
from accel._files.values import check_gradients, check_rng, check_values
from accel.checkpoint.rng import get_rng_state
from accel.core.scope import scope
from accel.errors import CheckpointError


def _reseal(ck: Path, filename: str) -> None:
    """Make the manifest vouch for ``filename`` as it now is."""
    manifest = json.loads((ck / "manifest.json").read_text())
    data = (ck / filename).read_bytes()
    for entry in manifest["files"]:
        if entry["name"] == filename:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (ck / "manifest.json").write_text(json.dumps(manifest))


def _edit_json(ck: Path, name: str, edit: Callable[[Any], None]) -> None:
    body = json.loads((ck / f"{name}.json").read_text())
    edit(body["state"])
    (ck / f"{name}.json").write_text(json.dumps(body))
    _reseal(ck, f"{name}.json")


def _edit_body(ck: Path, name: str, edit: Callable[[Any], None]) -> None:
    body = json.loads((ck / f"{name}.json").read_text())
    edit(body)
    (ck / f"{name}.json").write_text(json.dumps(body))
    _reseal(ck, f"{name}.json")


_NAMES = {"I32": "int32", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "F64": "float64", "I64": "int64"}


def _relabel(ck: Path, name: str, key: str, dtype: str, record: str = "also") -> None:
    """Change the dtype a safetensors header declares for ``key`` (same length, same bytes).

    ``record``: ``"also"`` changes the structure file's record of it too (a crafted
    checkpoint), ``"drop"`` removes the record (as in checkpoints written before it existed),
    ``"keep"`` leaves it (a header changed alone).
    """
    if record != "keep":
        def edit(body: Any) -> None:
            if record == "drop":
                del body["dtypes"]
            else:
                body["dtypes"][key] = _NAMES[dtype]

        _edit_body(ck, name, edit)
    path = ck / f"{name}.safetensors"
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    header[key]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    data[8:8 + size] = text + b" " * (size - len(text))
    path.write_bytes(bytes(data))
    _reseal(ck, f"{name}.safetensors")


def _setup(steps: int = 1) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    for _ in range(steps):
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _fresh() -> dict[str, Any]:
    torch.manual_seed(1)
    return _setup(steps=0)


def _saved(tmp_path: Path) -> Path:
    return accel.save_state(tmp_path / "ck", **_setup())


def _snapshot(objs: dict[str, Any]) -> Any:
    model = {k: v.clone() for k, v in objs["model"].state_dict().items()}
    opt = objs["optimizer"].state_dict()
    return model, json.dumps(opt["param_groups"]), len(opt["state"]), repr(
        objs["scheduler"].state_dict())


def _refused(ck: Path, *needles: str, objs: dict[str, Any] | None = None) -> str:
    objs = objs or _fresh()
    before = _snapshot(objs)
    with pytest.raises(CheckpointError) as caught:
        accel.load_state(ck, **objs)
    after = _snapshot(objs)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]), "model changed"
    assert before[1:] == after[1:], "optimizer or scheduler changed"
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))
    return str(caught.value)


def _set_lr(value: Any) -> Callable[[Any], None]:
    def edit(state: Any) -> None:
        state["param_groups"][0]["lr"] = value

    return edit


@pytest.mark.parametrize("value", ["abc", {"__float__": "nan"}, {"__float__": "inf"}, True,
                                   None, [0.1]])
def test_optimizer_lr_of_another_type_or_not_finite_is_refused(
    tmp_path: Path, value: Any
) -> None:
    ck = _saved(tmp_path)
    _edit_json(ck, "optimizer", _set_lr(value))
    _refused(ck, "'optimizer'", "['lr']")


def test_an_int_where_a_float_lives_loads(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    _edit_json(ck, "optimizer", _set_lr(1))
    objs = _fresh()
    accel.load_state(ck, **objs)
    assert objs["optimizer"].param_groups[0]["lr"] == 1


def test_betas_and_flags_keep_their_types(tmp_path: Path) -> None:
    ck = _saved(tmp_path)

    def edit(state: Any) -> None:
        state["param_groups"][0]["betas"] = {"__tuple__": [0.9, "x"]}
        state["param_groups"][0]["amsgrad"] = 1

    _edit_json(ck, "optimizer", edit)
    text = _refused(ck, "['betas'][1]", "['amsgrad']")
    assert "bool" in text


@pytest.mark.parametrize("value", ["abc", {"__float__": "nan"}, -1, {"__tensor__": "x"}])
def test_optimizer_step_count_is_a_finite_number(tmp_path: Path, value: Any) -> None:
    ck = _saved(tmp_path)

    def edit(state: Any) -> None:
        entries = dict(state["state"]["__dict__"])
        entries[0]["step"] = value

    if value == {"__tensor__": "x"}:  # a tensor reference the tensor file does not hold
        _edit_json(ck, "optimizer", edit)
        _refused(ck, "'x'")
        return
    _edit_json(ck, "optimizer", edit)
    _refused(ck, "['step']")


def test_optimizer_state_relabelled_to_integers_is_refused(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    header = _header(ck, "optimizer")
    key = next(k for k in header if k.endswith("exp_avg"))
    _relabel(ck, "optimizer", key, "I32")
    _refused(ck, "exp_avg", "float32")  # a fresh optimizer: checked against the parameter
    live = _setup(steps=1)  # an optimizer that has stepped: checked against its own state
    _refused(ck, "exp_avg", objs=live)


def _header(ck: Path, name: str) -> dict[str, Any]:
    data = (ck / f"{name}.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header: dict[str, Any] = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    return header


@pytest.mark.parametrize("record", ["also", "drop"])
def test_weights_relabelled_f32_to_i32_are_refused(tmp_path: Path, record: str) -> None:
    ck = _saved(tmp_path)
    _relabel(ck, "model", "0.weight", "I32", record)
    text = _refused(ck, "'0.weight'", "torch.int32", "floating")
    assert "model" in text


@pytest.mark.parametrize(("dtype", "wanted"), [("I32", "int32"), ("F16", "float16")])
def test_a_header_relabelled_after_the_save_differs_from_the_record(
    tmp_path: Path, dtype: str, wanted: str
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 3).to(torch.bfloat16 if dtype == "F16" else torch.float32)
    ck = accel.save_state(tmp_path / "ck", model=model)
    assert json.loads((ck / "model.json").read_text())["dtypes"]["weight"] in (
        "bfloat16", "float32")
    _relabel(ck, "model", "weight", dtype, record="keep")  # BF16 -> F16: both floating
    target = nn.Linear(3, 3).to(model.weight.dtype)
    before = target.weight.detach().clone()
    with pytest.raises(CheckpointError, match=f"'weight': {wanted} in the header"):
        accel.load_state(ck, model=target)
    assert torch.equal(target.weight, before)


def test_an_integer_buffer_relabelled_to_floats_is_refused(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    _relabel(ck, "model", "1.num_batches_tracked", "F64")
    _refused(ck, "num_batches_tracked", "integer")


@pytest.mark.parametrize(("key", "value"), [
    ("last_epoch", "3"),
    ("_last_lr", [{"__float__": "nan"}]),
    ("total_steps", None),
    ("_anneal_func_type", 3),
    ("base_lrs", "abc"),
])
def test_scheduler_values_of_another_type_are_refused(
    tmp_path: Path, key: str, value: Any
) -> None:
    ck = _saved(tmp_path)

    def edit(state: Any) -> None:
        state[key] = value

    _edit_json(ck, "scheduler", edit)
    _refused(ck, "'scheduler'", key)


def test_reduce_on_plateau_checks_its_options_and_takes_any_best(tmp_path: Path) -> None:
    def objects() -> dict[str, Any]:
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return {"model": model, "optimizer": opt,
                "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}

    objs = objects()
    objs["plateau"].step(0.5)  # best becomes finite where the fresh one is inf
    ck = accel.save_state(tmp_path / "ck", **objs)
    fresh = objects()
    accel.load_state(ck, **fresh)
    assert fresh["plateau"].best == 0.5

    def edit(state: Any) -> None:
        state["mode"] = "sideways"

    _edit_json(ck, "plateau", edit)
    fresh = objects()
    with pytest.raises(CheckpointError, match="sideways"):
        accel.load_state(ck, **fresh)
    assert fresh["plateau"].mode == "min"


def test_grad_scaler_values_are_checked(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with accel.distributed(mixed_precision="fp16"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = scope().grad_scaler
        assert scaler is not None
        ck = accel.save_state(tmp_path / "ck", model=model)

        def edit(state: Any) -> None:
            state["scale"] = "abc"

        _edit_json(ck, "grad_scaler", edit)
        before = scaler.state_dict()
        target = nn.Linear(2, 2)
        weight = target.weight.detach().clone()
        with pytest.raises(CheckpointError, match="scale"):
            accel.load_state(ck, model=target)
        assert scaler.state_dict() == before
        assert torch.equal(target.weight, weight)


def test_rng_and_accumulation_values_are_checked_before_any_object_changes(
    tmp_path: Path,
) -> None:
    ck = _saved(tmp_path)

    def rng(state: Any) -> None:
        state["python"]["state"] = "not a generator state"

    _edit_json(ck, "rng_rank0", rng)
    _refused(ck, "rng_rank0", "python")
    ck = accel.save_state(tmp_path / "ck2", **_setup())

    def counter(body: Any) -> None:
        body["extra"]["accumulation_step"] = "abc"

    _edit_body(ck, "model", counter)
    _refused(ck, "accumulation_step")


def test_check_values_directly() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    good = opt.state_dict()
    check_values("optimizer", opt, good)
    bad = {**good, "param_groups": [{**good["param_groups"][0], "momentum": float("nan")}]}
    with pytest.raises(CheckpointError, match="momentum"):
        check_values("optimizer", opt, bad)
    check_values("other", object(), {"anything": "goes"})  # objects accel does not know
    opt.param_groups[0]["dtype"] = torch.float32  # a dtype stays a dtype
    with pytest.raises(CheckpointError, match="'dtype'"):
        check_values("optimizer", opt, {**good, "param_groups": [
            {**good["param_groups"][0], "dtype": "float32"}]})


def test_rng_shapes_and_gradients_directly() -> None:
    live = get_rng_state()
    swapped = {**live, "torch": live["python"]["state"]}  # an int64 tensor of 625 values
    with pytest.raises(CheckpointError, match=r"\['torch'\].*shape"):
        check_rng("rng_rank0", live, swapped)
    check_rng("rng_rank0", live, live)
    model = nn.Linear(2, 3)
    check_gradients("model", "model__gradients_rank0", model, {"weight": torch.zeros(3, 2)})
    for grads, needle in [({"weight": torch.zeros(2, 3)}, "shape"),
                          ({"weight": torch.zeros(3, 2, dtype=torch.int64)}, "floating"),
                          ({"nope": torch.zeros(1)}, "no parameter")]:
        with pytest.raises(CheckpointError, match=needle):
            check_gradients("model", "model__gradients_rank0", model, grads)


def test_accelerate_format_values_are_checked_too(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck = tmp_path / "acc"
    ck.mkdir()
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
              ck / "model.safetensors", metadata={"format": "pt"})
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = "abc"
    torch.save(state, ck / "optimizer.bin")
    fresh = nn.Linear(3, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="lr"):
            accel.load_state(ck, model=fresh, optimizer=fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == 0.5


def test_a_good_checkpoint_of_every_kind_still_loads(tmp_path: Path) -> None:
    objs = _setup(steps=3)
    ck = accel.save_state(tmp_path / "ck", **objs)
    fresh = _fresh()
    accel.load_state(ck, **fresh)
    assert fresh["scheduler"].state_dict() == objs["scheduler"].state_dict()
    assert fresh["optimizer"].param_groups[0]["lr"] == objs["optimizer"].param_groups[0]["lr"]


@pytest.mark.parametrize("dispatch", [False, True])
def test_model_weights_with_integer_data_for_float_parameters_are_refused(
    tmp_path: Path, dispatch: bool
) -> None:
    """The transformers-layout loaders too: integer data never fills a float parameter."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    weights = {"weight": model.weight.detach().view(torch.int32).clone(),  # F32 bits as I32
               "bias": model.bias.detach().clone()}
    save_file(weights, tmp_path / "model.safetensors")
    target = nn.Linear(3, 3)
    before = target.weight.detach().clone()

    def load() -> None:
        if dispatch:
            accel.load_checkpoint_and_dispatch(target, tmp_path, device_map={"": "cpu"})
        else:
            accel.load_checkpoint_in_model(target, tmp_path / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"'weight' is torch\.int32"):
        load()
    assert torch.equal(target.weight, before)
