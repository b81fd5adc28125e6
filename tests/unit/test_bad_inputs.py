"""A table of bad inputs: each raises an ``accel.AccelError`` that is also the expected builtin
and whose message names the offending value.

Every case runs on one process (what N processes refuse, one process refuses too); the last
test runs the argument errors of the collectives on 2 gloo ranks.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accel
from accel.core.config_file import load_config
from accel.testing import run_distributed


@attrs.frozen
class Case:
    """``run(tmp_path, monkeypatch)`` must raise ``builtin`` naming each of ``needles``."""

    id: str
    run: Callable[[Path, pytest.MonkeyPatch], object]
    builtin: type[BaseException]
    needles: tuple[str, ...]


def _enter(manager: Any) -> None:
    with ExitStack() as stack:
        stack.enter_context(manager)


def _in_block(function: Callable[[], object]) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        with accel.distributed():
            return function()

    return run


def _options(**options: Any) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        _enter(accel.distributed(**options))
        return None

    return run


def _environment(name: str, value: str) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        monkeypatch.setenv(name, value)
        _enter(accel.distributed())
        return None

    return run


def _config_file(text: str) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        path = tmp_path / "accel.toml"
        path.write_text(text, encoding="utf-8")
        return load_config(path)

    return run


def _config_file_in_distributed(text: str) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        path = tmp_path / "accel.toml"
        path.write_text(text, encoding="utf-8")
        monkeypatch.setenv("ACCEL_CONFIG_FILE", str(path))
        _enter(accel.distributed())
        return None

    return run


def _split(inputs: Any) -> Callable[[], object]:
    def run() -> object:
        with accel.split_between_processes(inputs) as mine:
            return mine

    return run


def _gated_gather_for_metrics() -> object:
    @accel.on_main_process
    def report() -> object:
        return accel.gather_for_metrics(torch.ones(2))

    return report()


def _tracking(**options: Any) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        _enter(accel.tracking(tmp_path / "runs", **options))
        return None

    return run


def _log(values: Any, step: Any = None) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        with accel.tracking(tmp_path / "runs"):
            accel.log(values, step=step)
        return None

    return run


def _tracker_not_in_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    with accel.tracking(tmp_path / "runs", log_with="jsonl"):
        return accel.get_tracker("wandb")


def _search_without_batch_size() -> object:
    def train(model: object) -> None: ...

    return accel.find_executable_batch_size(train)


def _pickle_prepared_optimizer() -> object:
    model = nn.Linear(2, 2)
    return pickle.dumps(accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)))


# ------------------------------------------------------------------------- checkpoints


def _saved(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    """A checkpoint of a Linear(4, 2) and its Adam state (one step taken)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    directory = tmp_path / "ckpt"
    accel.save_state(directory, model=model, optimizer=optimizer)
    return directory, model, optimizer


def _damaged(mutate: Callable[[Path], None]) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        directory, model, optimizer = _saved(tmp_path)
        mutate(directory)
        return accel.load_state(directory, model=model, optimizer=optimizer)

    return run


def _truncate(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _entry_outside(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][0]["name"] = "../evil.safetensors"
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _manifest_not_json(directory: Path) -> None:
    (directory / "manifest.json").write_text("{not json")


def _wrong_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    directory, _, optimizer = _saved(tmp_path)
    return accel.load_state(directory, model=nn.Linear(4, 3), optimizer=optimizer)


def _optimizer_for_other_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    directory, model, _ = _saved(tmp_path)
    other = torch.optim.Adam(nn.Linear(4, 3).parameters(), lr=0.1)
    return accel.load_state(directory, model=model, optimizer=other)


def _names_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    directory, model, _ = _saved(tmp_path)
    return accel.load_state(directory, model=model, scheduler=model)


def _tensor_names_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    directory, _, optimizer = _saved(tmp_path)
    return accel.load_state(directory, model=nn.Sequential(nn.Linear(4, 2)), optimizer=optimizer)


def _weights_of_other_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    accel.save_model(nn.Linear(4, 2), tmp_path / "weights")
    return accel.load_checkpoint_in_model(nn.Linear(4, 3), tmp_path / "weights")


def _load_garbage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"not a checkpoint at all")
    return accel.load(path)


def _load_truncated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    path = tmp_path / "cut.safetensors"
    accel.save({"a": torch.ones(4)}, path)
    path.write_bytes(path.read_bytes()[:-3])
    return accel.load(path)


def _copy_into(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    directory, model, optimizer = _saved(tmp_path)
    shutil.copy(directory / "manifest.json", directory / "manifest.json.bak")
    return accel.save_state(directory, model=model, optimizer=optimizer, total_limit=-1)


def _plain(function: Callable[[], object]) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        return function()

    return run


def _at(function: Callable[[Path], object]) -> Callable[[Path, pytest.MonkeyPatch], object]:
    def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
        return function(tmp_path)

    return run


def _noop(*args: object) -> None:
    return None


_LINEAR = nn.Linear(2, 2)

CASES = [
    # distributed() options, environment and config files
    Case("mixed_precision", _options(mixed_precision="fp32"), ValueError, ("'fp32'",)),
    Case("strategy", _options(strategy="zero3"), ValueError, ("'zero3'",)),
    Case("backend", _options(backend="mpi2"), ValueError, ("'mpi2'",)),
    Case("accumulation_steps_0", _options(gradient_accumulation_steps=0), ValueError,
         ("gradient_accumulation_steps=0",)),
    Case("accumulation_steps_str", _options(gradient_accumulation_steps="2"), ValueError,
         ("'2'",)),
    Case("timeout_text", _options(timeout="soon"), ValueError, ("'soon'",)),
    Case("timeout_negative", _options(timeout=-1), ValueError, ("timeout=-1",)),
    Case("timeout_nan", _options(timeout=float("nan")), ValueError, ("nan",)),
    Case("debug", _options(debug="maybe"), ValueError, ("'maybe'",)),
    Case("cpu", _options(cpu="yes"), ValueError, ("'yes'",)),
    Case("on_each_node", _options(on_each_node="x"), ValueError, ("'x'",)),
    Case("seed", _options(seed="abc"), ValueError, ("'abc'",)),
    Case("env_mixed_precision", _environment("ACCEL_MIXED_PRECISION", "fp32"), ValueError,
         ("ACCEL_MIXED_PRECISION", "'fp32'")),
    Case("env_world_size", _environment("WORLD_SIZE", "two"), ValueError, ("'two'",)),
    Case("env_timeout", _environment("ACCEL_TIMEOUT", "soon"), ValueError, ("'soon'",)),
    Case("config_value", _config_file('mixed_precision = "fp32"\n'), ValueError,
         ("accel.toml", "'fp32'")),
    Case("config_unknown_key", _config_file("mixed_precison = 'bf16'\n"), ValueError,
         ("'mixed_precison'",)),
    Case("config_syntax", _config_file("[[[\n"), ValueError, ("accel.toml",)),
    Case("config_number", _config_file("num_processes = 'x'\n"), ValueError, ("'x'",)),
    Case("config_float_for_int", _config_file("gradient_accumulation_steps = 1.5\n"),
         ValueError, ("1.5",)),
    Case("config_missing", _at(lambda p: load_config(p / "absent.toml")), ValueError,
         ("absent.toml",)),
    Case("config_read_by_distributed", _config_file_in_distributed("strategy = 'zero3'\n"),
         ValueError, ("accel.toml", "'zero3'")),
    # prepare_*
    Case("prepare_model", _in_block(lambda: accel.prepare_model("model")), TypeError,
         ("'model'",)),
    Case("prepare_model_option", _in_block(
        lambda: accel.prepare_model(nn.Linear(2, 2), find_unused_paramters=True)
    ), ValueError, ("find_unused_paramters",)),
    Case("prepare_optimizer", _in_block(lambda: accel.prepare_optimizer(42)), TypeError,
         ("42",)),
    Case("prepare_scheduler", _in_block(lambda: accel.prepare_scheduler("cosine")), TypeError,
         ("'cosine'",)),
    Case("prepare_data_loader", _in_block(lambda: accel.prepare_data_loader([1, 2])),
         TypeError, ("[1, 2]",)),
    Case("skip_first_batches", _in_block(
        lambda: accel.skip_first_batches(DataLoader(range(4)), -1)  # type: ignore[arg-type]
    ), TypeError, ("DataLoader",)),
    Case("pickle_prepared_optimizer", _in_block(_pickle_prepared_optimizer), TypeError,
         ("prepared optimizer",)),
    Case("clip_grad_norm", _in_block(lambda: accel.clip_grad_norm_(42, 1.0)), TypeError,
         ("42",)),
    Case("backward", _in_block(lambda: accel.backward(0.5)), TypeError, ("0.5",)),
    Case("accumulate", _in_block(lambda: _enter(accel.accumulate("model"))), TypeError,
         ("'model'",)),
    Case("no_sync", _in_block(lambda: _enter(accel.no_sync(42))), TypeError, ("42",)),
    Case("set_seed", _plain(lambda: accel.set_seed("abc")), ValueError, ("'abc'",)),
    # collectives
    Case("reduce_reduction", _in_block(lambda: accel.reduce(torch.ones(1), "avg")),
         ValueError, ("'avg'",)),
    Case("reduce_reduction_none", _in_block(lambda: accel.reduce(torch.ones(1), None)),
         ValueError, ("None",)),
    Case("broadcast_from_process", _in_block(
        lambda: accel.broadcast(torch.ones(1), from_process=5)
    ), ValueError, ("from_process=5",)),
    Case("broadcast_from_process_str", _in_block(
        lambda: accel.broadcast(torch.ones(1), from_process="0")
    ), ValueError, ("from_process='0'",)),
    Case("broadcast_object_from_process", _in_block(
        lambda: accel.broadcast_object("x", from_process=-1)
    ), ValueError, ("from_process=-1",)),
    Case("split_int", _in_block(_split(42)), TypeError, ("42",)),
    Case("split_str", _in_block(_split("abc")), TypeError, ("'abc'",)),
    Case("split_scalar_tensor", _in_block(_split(torch.tensor(3))), TypeError, ("tensor(3)",)),
    Case("split_apply_padding", _in_block(lambda: _enter(
        accel.split_between_processes([1, 2], apply_padding="yes")
    )), TypeError, ("'yes'",)),
    Case("reduce_scale", _in_block(lambda: accel.reduce(torch.ones(1), "sum", scale="half")),
         TypeError, ("'half'",)),
    Case("gather_str", _in_block(lambda: accel.gather("abc")), TypeError, ("'abc'",)),
    Case("pad_dim", _in_block(
        lambda: accel.pad_across_processes(torch.ones(2), dim="x")
    ), TypeError, ("dim='x'",)),
    Case("gather_for_metrics_gated", _in_block(_gated_gather_for_metrics), RuntimeError,
         ("gather_for_metrics", "on_main_process")),
    # gating
    Case("on_main_process", _plain(lambda: accel.on_main_process(42)), TypeError, ("42",)),
    Case("on_process_negative", _plain(lambda: accel.on_process(-1)), TypeError, ("-1",)),
    Case("on_process_str", _plain(lambda: accel.on_process("a")), TypeError, ("'a'",)),
    Case("get_logger_name", _plain(lambda: accel.get_logger(42)), TypeError, ("42",)),
    Case("get_logger_level", _plain(lambda: accel.get_logger("x", log_level="LOUD")),
         ValueError, ("'LOUD'",)),
    # trackers
    Case("tracker_name", _tracking(log_with="nope"), ValueError, ("'nope'",)),
    Case("tracking_project_dir", _plain(lambda: _enter(accel.tracking(42))), ValueError,
         ("42",)),
    Case("tracker_entry", _tracking(log_with=["jsonl", 42]), ValueError, ("42",)),
    Case("run_name", _tracking(run_name=".."), ValueError, ("'..'",)),
    Case("tracking_config", _tracking(config=42), ValueError, ("42",)),
    Case("init_kwargs", _tracking(init_kwargs=42), ValueError, ("42",)),
    Case("init_kwargs_jsonl", _tracking(init_kwargs={"jsonl": {"flush": True}}), TypeError,
         ("'flush'",)),
    Case("log_outside_tracking", _plain(lambda: accel.log({"loss": 1.0})), RuntimeError,
         ("accel.log()",)),
    Case("log_object", _log({"loss": object()}), TypeError, ("'loss'", "object")),
    Case("log_vector", _log({"loss": torch.ones(3)}), ValueError, ("'loss'", "(3,)")),
    Case("log_step", _log({"loss": 1.0}, step="x"), TypeError, ("'x'",)),
    Case("get_tracker", _tracker_not_in_block, ValueError, ("'wandb'",)),
    # progress, memory, uneven inputs
    Case("progress", _plain(lambda: accel.progress(42)), TypeError, ("42",)),
    Case("batch_size_start", _plain(
        lambda: accel.find_executable_batch_size(starting_batch_size=-1)
    ), ValueError, ("starting_batch_size=-1",)),
    Case("batch_size_not_function", _plain(lambda: accel.find_executable_batch_size(42)),
         TypeError, ("42",)),
    Case("batch_size_parameter", _plain(_search_without_batch_size), TypeError,
         ("train(model",)),
    Case("join_uneven_inputs", _in_block(lambda: _enter(accel.join_uneven_inputs([42]))),
         TypeError, ("42",)),
    # checkpoints
    Case("checkpoint_truncated", _damaged(_truncate), ValueError, ("model.safetensors",)),
    Case("checkpoint_flipped_byte", _damaged(_flip_byte), ValueError,
         ("model.safetensors", "CRC32")),
    Case("checkpoint_entry_outside", _damaged(_entry_outside), ValueError,
         ("'../evil.safetensors'",)),
    Case("checkpoint_manifest_not_json", _damaged(_manifest_not_json), ValueError,
         ("manifest.json",)),
    Case("checkpoint_wrong_shapes", _wrong_shapes, ValueError, ("(2, 4)", "(3, 4)")),
    Case("checkpoint_optimizer_shapes", _optimizer_for_other_shapes, ValueError,
         ("exp_avg", "(3, 4)")),
    Case("checkpoint_names_absent", _names_absent, ValueError, ("['scheduler']",)),
    Case("checkpoint_tensor_names_absent", _tensor_names_absent, ValueError,
         ("'0.weight'",)),
    Case("checkpoint_total_limit", _copy_into, ValueError, ("total_limit=-1",)),
    Case("checkpoint_no_objects", _at(lambda p: accel.load_state(p)), ValueError,
         ("accel.load_state(",)),
    Case("checkpoint_object_name", _at(lambda p: accel.save_state(p, **{"my-model": _LINEAR})),
         ValueError, ("'my-model'",)),
    Case("checkpoint_object_type", _at(lambda p: accel.save_state(p, model=42)), ValueError,
         ("model=", "42")),
    Case("checkpoint_path_type", _plain(lambda: accel.save_state(42, model=_LINEAR)),
         TypeError, ("42",)),
    Case("save_model_not_a_model", _at(lambda p: accel.save_model("model", p)), TypeError,
         ("'model'",)),
    Case("weights_wrong_shapes", _weights_of_other_shapes, ValueError, ("'weight'", "[3, 4]")),
    Case("load_garbage", _load_garbage, ValueError, ("garbage.safetensors",)),
    Case("load_truncated", _load_truncated, ValueError, ("cut.safetensors",)),
    Case("load_missing", _at(lambda p: accel.load(p / "absent.pt")), ValueError,
         ("absent.pt",)),
    Case("save_safetensors_non_tensor", _at(
        lambda p: accel.save({"step": 3}, p / "x.safetensors")
    ), ValueError, ("'step'",)),
    # launching and testing helpers, big models
    Case("notebook_processes", _plain(lambda: accel.notebook_launcher(_noop, num_processes=0)),
         ValueError, ("num_processes=0",)),
    Case("run_distributed_world_size", _plain(
        lambda: run_distributed(_noop, world_size=0)
    ), ValueError, ("world_size=0",)),
    Case("init_on_device", _plain(lambda: _enter(accel.init_on_device("nodevice"))),
         ValueError, ("'nodevice'",)),
    Case("infer_auto_device_map", _plain(lambda: accel.infer_auto_device_map("gpt2")),
         TypeError, ("'gpt2'",)),
    Case("cpu_offload", _plain(lambda: accel.cpu_offload(42)), TypeError, ("42",)),
    Case("dispatch_model", _plain(lambda: accel.dispatch_model(42, {"": "cpu"})), TypeError,
         ("42",)),
    Case("max_memory_key", _plain(
        lambda: accel.infer_auto_device_map(nn.Linear(2, 2), max_memory={"gpu0": 10})
    ), ValueError, ("'gpu0'",)),
]


def test_the_table_is_large_and_ids_are_unique() -> None:
    assert len(CASES) >= 40
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_raises_an_accel_error_naming_it(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(accel.AccelError) as info:
        case.run(tmp_path, monkeypatch)
    error = info.value
    assert isinstance(error, case.builtin), (type(error).__mro__, case.builtin)
    message = str(error)
    for needle in case.needles:
        assert needle in message, (needle, message)


def _collective_argument_errors() -> list[tuple[str, str]]:
    """Each rank tries the same bad calls; none communicates, so none hangs."""
    seen = []
    calls: list[Callable[[], object]] = [
        lambda: accel.broadcast(torch.ones(1), from_process=2),
        lambda: accel.broadcast_object("x", from_process=2),
        lambda: accel.reduce(torch.ones(1), "avg"),
        lambda: accel.pad_across_processes(torch.ones(2), dim="x"),
        _split(42),
        _gated_gather_for_metrics,
    ]
    for call in calls:
        try:
            call()
        except accel.AccelError as exc:
            seen.append((type(exc).__name__, str(exc)))
    accel.wait_for_everyone()  # the ranks are still in step
    return seen


@pytest.mark.ci_extra
def test_collective_argument_errors_on_two_ranks() -> None:
    results = run_distributed(_collective_argument_errors, world_size=2, timeout=60)
    assert results[0][:5] == results[1]  # the gated call runs on rank 0 only
    names = [name for name, _ in results[0]]
    assert names == [
        *["CollectiveArgumentError"] * 3, *["CollectiveTypeError"] * 2, "GatedCollectiveError"
    ]
    messages = [message for _, message in results[0]]
    assert "from_process=2" in messages[0] and "0..1" in messages[0]
    assert "'avg'" in messages[2]
