"""load_state reads directories written by HuggingFace Accelerate's ``Accelerator.save_state``.

The fixtures are built by hand in Accelerate's exact layout (safetensors / torch.save files,
numbered by kind, pickled RNG and custom states); Accelerate itself is only used, when the
bench venv has it, by the last test. The ``.pkl`` files are malicious pickles, and an audit
hook records every file opened, to show accel never opens them.
"""

from __future__ import annotations

import builtins
import os
import pickle
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.checkpoint._from_accelerate import AccelerateCheckpointInfo
from accel.core.scope import scope
from accel.errors import CheckpointError

BENCH_PYTHON = Path("/work/benchvenv/bin/python")

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes | Path):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """Every path opened during the test (audit hook)."""
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


class _Exploit:
    """Unpickling it (with plain pickle) creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (os.fspath(self.marker), "w"))


def _poison(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"step": 3, "random_state": _Exploit(marker)}))


def _models() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


def _write(
    path: Path,
    marker: Path,
    *,
    models: tuple[nn.Module, ...] = (),
    optimizers: tuple[torch.optim.Optimizer, ...] = (),
    schedulers: tuple[Any, ...] = (),
    safe: bool = True,
    ranks: int = 1,
    custom: int = 0,
    prefix: str = "",
) -> None:
    """Write ``path`` as Accelerate's save_accelerator_state lays it out."""
    path.mkdir(parents=True, exist_ok=True)
    for i, model in enumerate(models):
        state = {prefix + k: v.detach().clone() for k, v in model.state_dict().items()}
        if safe:
            save_file(state, path / ("model.safetensors" if i == 0 else f"model_{i}.safetensors"),
                      metadata={"format": "pt"})
        else:
            torch.save(state, path / ("pytorch_model.bin" if i == 0 else f"pytorch_model_{i}.bin"))
    for i, opt in enumerate(optimizers):
        torch.save(opt.state_dict(), path / ("optimizer.bin" if i == 0 else f"optimizer_{i}.bin"))
    for i, sched in enumerate(schedulers):
        torch.save(sched.state_dict(), path / ("scheduler.bin" if i == 0 else f"scheduler_{i}.bin"))
    for rank in range(ranks):
        _poison(path / f"random_states_{rank}.pkl", marker)
    for i in range(custom):
        _poison(path / f"custom_checkpoint_{i}.pkl", marker)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opt_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(_same(a["state"][k], b["state"][k]) for k in a["state"])


@pytest.mark.parametrize("safe", [True, False])
def test_model_optimizer_scheduler_loaded_and_next_step_equal(
    tmp_path: Path, opened: list[str], safe: bool
) -> None:
    marker = tmp_path / "pwned"
    model, opt, sched = _models()
    _train(model, opt, sched, 0)
    ckpt = tmp_path / "acc"
    _write(ckpt, marker, models=(model,), optimizers=(opt,), schedulers=(sched,), safe=safe,
           custom=1)
    fresh, fresh_opt, fresh_sched = _models()
    opened.clear()  # from here on: the load
    with accel.distributed(), pytest.warns(UserWarning, match="Accelerate checkpoint") as caught:
        info = accel.load_state(ckpt, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert isinstance(info, AccelerateCheckpointInfo)
    assert info.path == ckpt and info.step is None and info.world_size == 1
    assert info.objects == ("model", "optimizer", "scheduler")
    weights = "model.safetensors" if safe else "pytorch_model.bin"
    assert info.files_used == (weights, "optimizer.bin", "scheduler.bin")
    assert info.files_refused == ("custom_checkpoint_0.pkl", "random_states_0.pkl")
    text = " ".join(str(w.message) for w in caught)
    assert "RNG states were not restored" in text
    assert "['custom_checkpoint_0.pkl', 'random_states_0.pkl']" in text and "set_seed" in text
    assert _same(model.state_dict(), fresh.state_dict())
    assert _opt_equal(opt.state_dict(), fresh_opt.state_dict())
    assert sched.state_dict() == fresh_sched.state_dict()
    _train(model, opt, sched, 1)
    _train(fresh, fresh_opt, fresh_sched, 1)
    assert _same(model.state_dict(), fresh.state_dict())
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    assert not marker.exists()
    assert not [p for p in opened if p.endswith(".pkl")], opened
    assert any(p.endswith(weights) for p in opened)


def test_info_log_names_used_unused_and_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt, _ = _models()
    other = nn.Linear(2, 2)
    ckpt = tmp_path / "acc"
    _write(ckpt, tmp_path / "m", models=(model, other), optimizers=(opt,), ranks=2)
    with accel.distributed(), warnings.catch_warnings(), caplog.at_level("INFO"):
        warnings.simplefilter("ignore")
        accel.load_state(ckpt, model=_models()[0])
    text = caplog.text
    assert "used ['model.safetensors']" in text
    assert "not used ['model_1.safetensors', 'optimizer.bin']" in text
    assert "['random_states_0.pkl', 'random_states_1.pkl']" in text


def test_objects_numbered_by_kind_in_keyword_order(tmp_path: Path) -> None:
    first, second = nn.Linear(3, 5), nn.Linear(5, 2)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(second.parameters(), lr=0.2, momentum=0.9)
    for m, o in ((first, opt_a), (second, opt_b)):
        m(torch.randn(2, m.in_features)).sum().backward()
        o.step()
    ckpt = tmp_path / "acc"
    _write(ckpt, tmp_path / "m", models=(first, second), optimizers=(opt_a, opt_b))
    a, b = nn.Linear(3, 5), nn.Linear(5, 2)
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.2, momentum=0.9)
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = accel.load_state(ckpt, encoder=a, opt_enc=oa, head=b, opt_head=ob)
        assert isinstance(info, AccelerateCheckpointInfo)
        assert info.files_used == (
            "model.safetensors", "optimizer.bin", "model_1.safetensors", "optimizer_1.bin"
        )
        assert _same(first.state_dict(), a.state_dict())
        assert _same(second.state_dict(), b.state_dict())
        assert _opt_equal(opt_b.state_dict(), ob.state_dict())
        before = {k: v.clone() for k, v in a.state_dict().items()}
        with pytest.raises(CheckpointError, match="in the order of the keywords") as caught:
            accel.load_state(ckpt, head=nn.Linear(5, 2), encoder=a)
    assert "does not match" in str(caught.value) or "other shapes" in str(caught.value)
    assert _same(before, a.state_dict())  # verified before anything changed


def test_ddp_prefix_and_tied_weights(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    nn.init.normal_(model.emb.weight)
    state = {"module." + k: v.clone() for k, v in model.state_dict().items()
             if k != "head.weight"}  # safetensors keeps one name of a shared tensor
    ckpt = tmp_path / "acc"
    ckpt.mkdir()
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    fresh = Tied()
    with accel.distributed():
        info = accel.load_state(ckpt, model=fresh)
    assert info is not None and info.world_size == 1 and info.files_refused == ()
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    assert fresh.head.weight is fresh.emb.weight


def test_fp16_scaler_restored(tmp_path: Path) -> None:
    saved = torch.amp.GradScaler("cpu", init_scale=1024.0)
    saved.load_state_dict({**saved.state_dict(), "scale": 32.0, "_growth_tracker": 7})
    model, opt, _ = _models()
    ckpt = tmp_path / "acc"
    _write(ckpt, tmp_path / "m", models=(model,))
    torch.save(saved.state_dict(), ckpt / "scaler.pt")
    with accel.distributed(mixed_precision="fp16"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accel.prepare_optimizer(opt)
        info = accel.load_state(ckpt, model=model)
        scaler = scope().grad_scaler
        assert scaler is not None and scaler.state_dict()["scale"] == 32.0
        assert scaler.state_dict()["_growth_tracker"] == 7
        assert info is not None and "scaler.pt" in getattr(info, "files_used", ())
    explicit = torch.amp.GradScaler("cpu")
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accel.load_state(ckpt, model=model, scaler=explicit)
    assert explicit.state_dict()["scale"] == 32.0


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_custom_object_in_pickle_is_refused(tmp_path: Path, opened: list[str]) -> None:
    marker = tmp_path / "pwned"
    model, _, _ = _models()
    ckpt = tmp_path / "acc"
    _write(ckpt, marker, models=(model,), custom=1)
    fresh = _models()[0]
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    opened.clear()
    with accel.distributed(), pytest.raises(CheckpointError) as caught:
        accel.load_state(ckpt, model=fresh, ema=_Counter())
    text = str(caught.value)
    assert "ema= (_Counter)" in text and "custom_checkpoint_0.pkl" in text
    assert "never opens" in text and "weights_only=True" in text and "leave ema= out" in text
    assert _same(before, fresh.state_dict())  # nothing changed
    assert not marker.exists() and not [p for p in opened if p.endswith(".pkl")]
    (ckpt / "custom_checkpoint_0.pkl").unlink()
    with accel.distributed(), pytest.raises(CheckpointError, match="it is absent"):
        accel.load_state(ckpt, model=fresh, ema=_Counter())


def test_missing_files_name_the_object(tmp_path: Path) -> None:
    model, opt, sched = _models()
    ckpt = tmp_path / "acc"
    _write(ckpt, tmp_path / "m", models=(model,))
    with accel.distributed():
        with pytest.raises(CheckpointError, match=r"no optimizer\.bin for optimizer="):
            accel.load_state(ckpt, model=model, optimizer=opt)
        with pytest.raises(CheckpointError, match=r"no scheduler\.bin for sched="):
            accel.load_state(ckpt, sched=sched)
        with pytest.raises(CheckpointError, match=r"no model_1\.safetensors or pytorch_model_1"):
            accel.load_state(ckpt, a=model, b=nn.Linear(2, 2))
        loader = accel.prepare_data_loader(DataLoader(TensorDataset(torch.arange(8.0)), 2))
        with pytest.raises(CheckpointError, match="skip_first_batches") as caught:
            accel.load_state(ckpt, model=model, train_loader=loader)
    assert "sampler.bin or dl_state_dict.bin for train_loader=" in str(caught.value)
    assert "use_stateful_dataloader=True" in str(caught.value)


def test_sharded_fsdp_layout_is_explained(tmp_path: Path) -> None:
    ckpt = tmp_path / "acc"
    (ckpt / "pytorch_model_fsdp_0").mkdir(parents=True)
    _poison(ckpt / "random_states_0.pkl", tmp_path / "m")
    with accel.distributed(), pytest.raises(CheckpointError, match="sharded FSDP/DeepSpeed"):
        accel.load_state(ckpt, model=nn.Linear(2, 2))


def test_refused_or_mismatched_files_change_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    model, opt, _ = _models()
    ckpt = tmp_path / "acc"
    _write(ckpt, marker, models=(model,), optimizers=(opt,))
    (ckpt / "optimizer.bin").write_bytes(pickle.dumps(_Exploit(marker), protocol=2))
    fresh, fresh_opt, _ = _models()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with accel.distributed(), pytest.raises(CheckpointError) as caught:
        accel.load_state(ckpt, model=fresh, optimizer=fresh_opt)
    assert "optimizer.bin" in str(caught.value) and "refused" in str(caught.value)
    assert "(the state of optimizer=)" in str(caught.value)
    assert "Unsupported global" in str(caught.value)
    assert _same(before, fresh.state_dict()) and not marker.exists()
    with accel.distributed(), pytest.raises(CheckpointError, match="other shapes"):
        accel.load_state(ckpt, model=nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)))
    torch.save(opt.state_dict(), ckpt / "optimizer.bin")
    data = (ckpt / "optimizer.bin").read_bytes()
    (ckpt / "optimizer.bin").write_bytes(data[: len(data) // 2])  # cut short
    with accel.distributed(), pytest.raises(CheckpointError, match="corrupted or unreadable"):
        accel.load_state(ckpt, optimizer=fresh_opt)


def test_neither_layout_says_what_was_found(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    (tmp_path / "empty").mkdir()
    model = nn.Linear(2, 2)
    with accel.distributed():
        with pytest.raises(CheckpointError, match="No complete checkpoint") as caught:
            accel.load_state(tmp_path / "notes", model=model)
        assert "['readme.txt']" in str(caught.value)
        assert "Accelerate's save_state" in str(caught.value)
        with pytest.raises(CheckpointError, match="it is an empty directory"):
            accel.load_state(tmp_path / "empty", model=model)
        with pytest.raises(CheckpointError, match="it does not exist"):
            accel.load_state(tmp_path / "absent", model=model)
        assert accel.load_state(tmp_path / "absent", missing_ok=True, model=model) is None


def test_root_of_accelerate_numbered_checkpoints_loads_newest(tmp_path: Path) -> None:
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    _write(tmp_path / "checkpoints" / "checkpoint_0", tmp_path / "m", models=(old,))
    _write(tmp_path / "checkpoints" / "checkpoint_1", tmp_path / "m", models=(new,))
    fresh = nn.Linear(2, 2)
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = accel.load_state(tmp_path / "checkpoints", model=fresh)
    assert info is not None and info.path == tmp_path / "checkpoints" / "checkpoint_1"
    assert _same(new.state_dict(), fresh.state_dict())


def test_accel_checkpoints_are_unaffected(tmp_path: Path) -> None:
    model, fresh = nn.Linear(2, 2), nn.Linear(2, 2)
    with accel.distributed():
        accel.save_state(tmp_path / "root", step=3, model=model)
        info = accel.load_state(tmp_path / "root", model=fresh)
    assert info is not None and not isinstance(info, AccelerateCheckpointInfo) and info.step == 3
    assert _same(model.state_dict(), fresh.state_dict())


# --- data loaders -------------------------------------------------------------------------


class _Data(TensorDataset):
    """A user dataset class: if its pickled state were applied, the marker would be written."""

    marker = ""

    def __setstate__(self, state: dict[str, Any]) -> None:
        Path(self.marker).write_text("ran")
        self.__dict__.update(state)


@pytest.fixture
def fake_accelerate(monkeypatch: pytest.MonkeyPatch) -> type:
    """A class pickled under Accelerate's qualified name, as sampler.bin holds it."""

    class SeedableRandomSampler(torch.utils.data.RandomSampler):
        def __init__(self, data: Any, seed: int) -> None:
            super().__init__(data, generator=torch.Generator().manual_seed(seed))
            self.initial_seed, self.epoch = seed, 0

        def __setstate__(self, state: dict[str, Any]) -> None:  # pragma: no cover - never runs
            raise AssertionError("the sampler's own code ran")

    package = types.ModuleType("accelerate")
    module = types.ModuleType("accelerate.data_loader")
    SeedableRandomSampler.__module__ = "accelerate.data_loader"
    SeedableRandomSampler.__qualname__ = "SeedableRandomSampler"
    module.SeedableRandomSampler = SeedableRandomSampler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "accelerate", package)
    monkeypatch.setitem(sys.modules, "accelerate.data_loader", module)
    user = types.ModuleType("accelerate.user_data")
    user._Data = _Data  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "accelerate.user_data", user)
    monkeypatch.setattr(_Data, "__module__", "accelerate.user_data")
    return SeedableRandomSampler


def test_sampler_bin_restores_the_epoch_without_running_code(
    tmp_path: Path, fake_accelerate: type, opened: list[str]
) -> None:
    marker = tmp_path / "pwned"
    _Data.marker = os.fspath(marker)
    sampler = fake_accelerate(_Data(torch.arange(10.0)), 42)
    sampler.epoch = 3
    ckpt = tmp_path / "acc"
    _write(ckpt, marker, models=(nn.Linear(2, 2),))
    torch.save(sampler, ckpt / "sampler.bin")
    opened.clear()
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = accel.prepare_data_loader(
            DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2, shuffle=True)
        )
        info = accel.load_state(ckpt, model=nn.Linear(2, 2), train_loader=loader)
        position = loader.state_dict()
    assert info is not None and "sampler.bin" in getattr(info, "files_used", ())
    assert position["epoch"] == 3 and position["batches_yielded"] == 0
    with accel.distributed(), pytest.raises(CheckpointError, match=r"accel\.prepare_data_loader"):
        accel.load_state(ckpt, train_loader=_Stateful())
    assert not marker.exists()
    assert not [p for p in opened if p.endswith(".pkl")]


def test_sampler_bin_that_is_no_sampler_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "acc"
    _write(ckpt, marker, models=(nn.Linear(2, 2),))
    torch.save({"epoch": 1}, ckpt / "sampler.bin")
    with accel.distributed():
        loader = accel.prepare_data_loader(DataLoader(TensorDataset(torch.arange(4.0)), 2))
        with pytest.raises(CheckpointError, match="SeedableRandomSampler with an integer epoch"):
            accel.load_state(ckpt, train_loader=loader)
        (ckpt / "sampler.bin").write_bytes(pickle.dumps(_Exploit(marker), protocol=2))
        with pytest.raises(CheckpointError, match="could not be read without running"):
            accel.load_state(ckpt, train_loader=loader)
        torch.save(_Exploit(marker), ckpt / "sampler.bin")  # names builtins.open: stood in for
        with pytest.raises(CheckpointError, match="the sampler of train_loader="):
            accel.load_state(ckpt, train_loader=loader)
    assert not marker.exists()


class _Stateful(DataLoader[Any]):
    """Stands for torchdata's StatefulDataLoader: it takes its own state dict back."""

    def __init__(self) -> None:
        super().__init__(TensorDataset(torch.arange(4.0)), batch_size=2)
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_dl_state_dict_bin(tmp_path: Path) -> None:
    ckpt = tmp_path / "acc"
    _write(ckpt, tmp_path / "m", models=(nn.Linear(2, 2),))
    raw = {"_num_yielded": 3, "_iterator_finished": False, "_sampler_iter_yielded": 3}
    torch.save(raw, ckpt / "dl_state_dict.bin")
    torch.save({**raw, "_iterator_finished": True}, ckpt / "dl_state_dict_1.bin")
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stateful = _Stateful()
        accel.load_state(ckpt, train_loader=stateful)
        assert stateful.loaded == raw
        first = accel.prepare_data_loader(DataLoader(TensorDataset(torch.arange(20.0)), 2))
        second = accel.prepare_data_loader(DataLoader(TensorDataset(torch.arange(20.0)), 2))
        start = first.state_dict()["epoch"]
        accel.load_state(ckpt, train_loader=first, eval_loader=second)
        assert (first.state_dict()["epoch"], first.state_dict()["batches_yielded"]) == (start, 3)
        assert second.state_dict()["epoch"] == start + 1
        assert second.state_dict()["batches_yielded"] == 0
        assert [int(b[0][0]) for b in first][:1] == [6]  # resumes after 3 batches of 2
        torch.save({"_num_yielded": -1}, ckpt / "dl_state_dict.bin")
        with pytest.raises(CheckpointError, match="no non-negative '_num_yielded'"):
            accel.load_state(ckpt, train_loader=first)


# --- a real Accelerate checkpoint ---------------------------------------------------------

_SCRIPT = r"""
import sys, torch
from torch import nn
from safetensors.torch import save_file
from accelerate import Accelerator
out = sys.argv[1]
torch.manual_seed(0)
acc = Accelerator(cpu=True)
def build():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters(), lr=0.05)
    return m, o, torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
m, o, s = acc.prepare(*build())
head = acc.prepare(nn.Linear(2, 3))
def step(seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    acc.backward(((m(x) - y) ** 2).mean()); o.step(); o.zero_grad(); s.step()
step(0)
acc.save_state(out + "/safe", safe_serialization=True)
acc.save_state(out + "/bin", safe_serialization=False)
step(1)
save_file({k: v.contiguous() for k, v in m.state_dict().items()}, out + "/after.safetensors")
print(s.get_last_lr()[0])
"""


@pytest.fixture(scope="module")
def real_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """Checkpoints written by Accelerate's save_state in the bench venv (both formats)."""
    if not BENCH_PYTHON.exists():
        pytest.skip("no bench venv with Accelerate")
    out = tmp_path_factory.mktemp("real_accelerate")
    done = subprocess.run(
        [os.fspath(BENCH_PYTHON), "-c", _SCRIPT, os.fspath(out)],
        capture_output=True, text=True, timeout=300,
    )
    if done.returncode != 0 and "No module named 'accelerate'" in done.stderr:
        pytest.skip("Accelerate is not installed in the bench venv")
    assert done.returncode == 0, done.stderr[-2000:]
    return out, float(done.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("safe", [True, False])
def test_real_accelerate_save_state(
    real_checkpoints: tuple[Path, float], opened: list[str], safe: bool
) -> None:
    from safetensors.torch import load_file

    out, last_lr = real_checkpoints
    ckpt = out / ("safe" if safe else "bin")
    model, opt, sched = _models()
    head = nn.Linear(2, 3)
    opened.clear()
    with accel.distributed(), pytest.warns(UserWarning, match="random_states_0.pkl"):
        info = accel.load_state(ckpt, model=model, head=head, optimizer=opt, scheduler=sched)
    assert isinstance(info, AccelerateCheckpointInfo) and info.files_refused == (
        "random_states_0.pkl",
    )
    weights = ("model.safetensors", "model_1.safetensors") if safe else (
        "pytorch_model.bin", "pytorch_model_1.bin")
    assert info.files_used == (*weights, "optimizer.bin", "scheduler.bin")
    assert not [p for p in opened if p.endswith(".pkl")]
    saved_opt = torch.load(ckpt / "optimizer.bin", weights_only=True)
    assert _opt_equal(saved_opt, opt.state_dict())
    assert torch.load(ckpt / "scheduler.bin", weights_only=True) == sched.state_dict()
    _train(model, opt, sched, 1)
    assert _same(load_file(out / "after.safetensors"), model.state_dict())
    assert sched.get_last_lr()[0] == last_lr


def test_accel_checkpoint_without_manifest_is_not_taken_for_accelerate(tmp_path: Path) -> None:
    old, new, fresh = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    with accel.distributed():
        accel.save_state(tmp_path / "root", step=1, model=old)
        accel.save_state(tmp_path / "root", step=2, model=new)
        (tmp_path / "root" / "checkpoint_2" / "manifest.json").unlink()  # holds model.safetensors
        with pytest.warns(UserWarning, match="skipped checkpoints that failed verification"):
            info = accel.load_state(tmp_path / "root", model=fresh)
    assert info is not None and not isinstance(info, AccelerateCheckpointInfo) and info.step == 1
    assert _same(old.state_dict(), fresh.state_dict())
