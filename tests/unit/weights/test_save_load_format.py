"""accel.save / accel.load: the format follows the name, loading never runs code; the
``on_each_node`` option; and the tested hooks example of docs/checkpoints.md."""

from __future__ import annotations

import builtins
import dataclasses
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

import accel
from accel.core.config_file import parse_config
from accel.core.env import read_launch_env
from accel.errors import CheckpointArgumentError, CheckpointError, ConfigError
from accel.testing import fake_state

DOCS = Path(__file__).resolve().parents[3] / "docs" / "checkpoints.md"
DOC_MARKER = "<!-- tested: the block below runs in tests/unit/weights/test_save_load_format.py -->"


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- the format follows the name ---------------------------------------------------------


@pytest.mark.parametrize("name", ["model.pt", "model.bin", "critic", "weights.pth"])
def test_accelerate_docs_flow_save_then_plain_torch_load(tmp_path: Path, name: str) -> None:
    with accel.distributed():
        model = accel.prepare_model(_model())
        unwrapped = accel.unwrap_model(model)
        path = tmp_path / name
        accel.save(unwrapped.state_dict(), path)
        fresh = _model(1)
        fresh.load_state_dict(torch.load(path))  # plain torch, its default weights_only=True
    assert _equal(fresh.state_dict(), unwrapped.state_dict())
    assert _entries(tmp_path) == [name]  # no temporary file left beside it


def test_safetensors_name_or_flag_writes_safetensors(tmp_path: Path) -> None:
    state = _model().state_dict()
    accel.save(state, tmp_path / "model.safetensors")
    accel.save(state, tmp_path / "MODEL.SAFETENSORS")
    accel.save(state, tmp_path / "forced.bin", safe_serialization=True)  # Accelerate's flag
    for name in ("model.safetensors", "MODEL.SAFETENSORS", "forced.bin"):
        loaded = safetensors.torch.load_file(str(tmp_path / name))
        assert _equal(loaded, state)
        with safetensors.safe_open(str(tmp_path / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "forced.bin")  # not torch's format, as asked
    assert _equal(accel.load(tmp_path / "forced.bin"), state)  # read by its content


def test_safe_serialization_false_writes_torch_format(tmp_path: Path) -> None:
    state = _model().state_dict()
    accel.save(state, tmp_path / "plain.safetensors.bak", safe_serialization=False)
    assert _equal(torch.load(tmp_path / "plain.safetensors.bak"), state)
    with pytest.raises(CheckpointError, match=r"torch's format under a \.safetensors name"):
        accel.save(state, tmp_path / "odd.safetensors", safe_serialization=False)
    assert _entries(tmp_path) == ["plain.safetensors.bak"]


def test_load_goes_by_the_content_not_the_name(tmp_path: Path) -> None:
    state = _model().state_dict()
    torch.save(state, tmp_path / "torch_inside.safetensors")  # torch's format, misnamed
    accel.save(state, tmp_path / "safetensors_inside.pt", safe_serialization=True)
    assert _equal(accel.load(tmp_path / "torch_inside.safetensors"), state)
    assert _equal(accel.load(tmp_path / "safetensors_inside.pt"), state)


def test_torch_format_holds_nested_objects_and_keeps_ties_shared(tmp_path: Path) -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    tied = nn.Sequential(emb, head)
    opt = torch.optim.SGD(tied.parameters(), lr=0.1, momentum=0.9)
    tied(torch.tensor([1, 2])).sum().backward()
    opt.step()
    obj = {"model": tied.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
           "history": [0.5, 0.25], "name": "run", "dtype": torch.bfloat16}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's format keeps ties: nothing to warn about
        accel.save(obj, tmp_path / "everything.pt")
    for loaded in (torch.load(tmp_path / "everything.pt"), accel.load(tmp_path / "everything.pt")):
        assert loaded["epoch"] == 3 and loaded["history"] == [0.5, 0.25]
        assert loaded["dtype"] is torch.bfloat16 and loaded["name"] == "run"
        model_state = loaded["model"]
        assert torch.equal(model_state["0.weight"], tied[0].weight)
        assert model_state["0.weight"].data_ptr() == model_state["1.weight"].data_ptr()
        assert torch.equal(
            loaded["optimizer"]["state"][0]["momentum_buffer"],
            opt.state_dict()["state"][0]["momentum_buffer"],
        )


def test_safetensors_keeps_tied_tensors_in_full_with_a_warning(tmp_path: Path) -> None:
    emb = nn.Embedding(10, 4)
    state = {"emb": emb.weight.detach(), "head": emb.weight.detach()}
    with pytest.warns(UserWarning, match="share memory"):
        accel.save(state, tmp_path / "tied.safetensors")
    loaded = accel.load(tmp_path / "tied.safetensors")
    assert torch.equal(loaded["emb"], loaded["head"])
    assert loaded["emb"].data_ptr() != loaded["head"].data_ptr()


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"step": 3}, "value under 'step' is of type int"),
        ({"w": torch.ones(1), "opt": {"lr": torch.ones(1)}}, "value under 'opt' is of type dict"),
        ({1: torch.ones(1)}, "key 1 is of type int"),
        ([torch.ones(1)], "got an object of type list"),
        ({"w": torch.empty(2, device="meta")}, "under 'w' is on the meta device"),
    ],
)
def test_safetensors_refuses_what_it_cannot_hold(tmp_path: Path, obj: Any, match: str) -> None:
    target = tmp_path / "w.safetensors"
    with pytest.raises(CheckpointError, match=match):
        accel.save(obj, target)
    assert _entries(tmp_path) == []


@dataclasses.dataclass
class _Config:
    lr: float = 0.1


def test_torch_format_refuses_objects_that_weights_only_cannot_read(tmp_path: Path) -> None:
    target = tmp_path / "state.pt"
    accel.save({"epoch": 1}, target)
    before = target.read_bytes()
    with pytest.raises(CheckpointError, match=r"'cfg\.inner\[1\]' is of type .*_Config"):
        accel.save({"cfg": {"inner": [1, _Config()]}}, target)
    with pytest.raises(CheckpointError, match=r"value at 'fn'.*Nothing was written"):
        accel.save({"fn": len}, target)
    with pytest.raises(CheckpointError, match="value at 'local'"):
        accel.save({"local": lambda: 1}, target)  # torch.save itself cannot pickle it
    assert target.read_bytes() == before  # the old file is untouched
    assert _entries(tmp_path) == ["state.pt"]


def test_save_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(CheckpointArgumentError, match="safe_serialization='yes'"):
        accel.save({}, tmp_path / "x.pt", safe_serialization="yes")  # type: ignore[arg-type]
    with pytest.raises(CheckpointArgumentError, match="on_each_node=1"):
        accel.save({}, tmp_path / "x.pt", on_each_node=1)  # type: ignore[arg-type]
    with pytest.raises(CheckpointArgumentError, match="on_each_node='no'"):
        accel.save_model(_model(), tmp_path / "m", on_each_node="no")  # type: ignore[arg-type]
    with pytest.raises(CheckpointArgumentError, match="on_each_node=0"):
        accel.save_state(tmp_path / "s", on_each_node=0, model=_model())  # type: ignore[arg-type]
    assert _entries(tmp_path) == []


# --- accel.load ----------------------------------------------------------------------------


class _Evil:
    """Unpickling it would create a file: the side effect a malicious checkpoint runs."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return builtins.open, (str(self.sentinel), "w")


@pytest.mark.parametrize("kind", ["zip", "legacy", "pickle"])
def test_load_refuses_malicious_pickles_before_anything_runs(tmp_path: Path, kind: str) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    payload = {"w": torch.ones(2), "evil": _Evil(sentinel)}
    if kind == "zip":
        torch.save(payload, path)
    elif kind == "legacy":
        torch.save(payload, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match=r"evil\.pt.*refused.*no code from a file ever runs"):
        accel.load(path)
    assert not sentinel.exists()
    if kind == "zip":  # the payload is real: an unsafe load does run it
        torch.load(path, weights_only=False)
        assert sentinel.exists()


def test_load_reads_both_formats_and_honours_map_location(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 4), "b": torch.arange(5), "flag": torch.tensor(True),
             "half": torch.randn(2).to(torch.bfloat16), "empty": torch.empty(0, 3),
             "scalar": torch.tensor(2.5)}
    accel.save(state, tmp_path / "s.safetensors")
    accel.save(state, tmp_path / "s.pt")
    for name in ("s.safetensors", "s.pt"):
        loaded = accel.load(tmp_path / name)
        assert _equal(loaded, state)
        assert all(v.dtype == state[k].dtype and v.shape == state[k].shape
                   for k, v in loaded.items())
        on_meta = accel.load(tmp_path / name, map_location=torch.device("meta"))
        assert all(v.device.type == "meta" for v in on_meta.values())
    loaded = accel.load(tmp_path / "s.safetensors")
    loaded["w"].add_(1)  # memory of its own: the file is not changed
    assert _equal(accel.load(tmp_path / "s.safetensors"), state)
    old_format = tmp_path / "old.pt"
    torch.save(state, old_format, _use_new_zipfile_serialization=False)
    assert _equal(accel.load(old_format), state)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing\.pt'.*no such file"):
        accel.load(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        accel.load(tmp_path)
    (tmp_path / "notes.txt").write_text("hello, not a checkpoint")
    with pytest.raises(CheckpointError, match=r"notes\.txt'.*neither safetensors nor torch"):
        accel.load(tmp_path / "notes.txt")
    accel.save({"w": torch.arange(100.0)}, tmp_path / "w.safetensors")
    accel.save({"w": torch.arange(100.0)}, tmp_path / "w.pt")
    for name in ("w.safetensors", "w.pt"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / f"cut-{name}").write_bytes(data[: len(data) * 3 // 4])
        with pytest.raises(CheckpointError, match=f"cut-{name}'.*(truncated|corrupted)"):
            accel.load(tmp_path / f"cut-{name}")
    with pytest.raises(ConfigError, match="map_location='gpu'"):
        accel.load(tmp_path / "w.pt", map_location="gpu")
    with pytest.raises(ConfigError, match=r"map_location=3\.5"):
        accel.load(tmp_path / "w.pt", map_location=3.5)  # type: ignore[arg-type]


# --- who writes: main process, or each machine's local main process -----------------------


def test_only_the_main_process_writes_unless_on_each_node(tmp_path: Path) -> None:
    state = _model().state_dict()
    second_machine = dict(rank=2, local_rank=0, world_size=4, local_world_size=2, node_rank=1,
                          num_nodes=2)
    with fake_state(**second_machine):  # a local main process, not the main process
        accel.save(state, tmp_path / "default.pt")
        accel.save_model(_model(), tmp_path / "default_export")
        accel.save(state, tmp_path / "each.pt", on_each_node=True)
        accel.save_model(_model(), tmp_path / "each_export", on_each_node=True)
    with fake_state(**second_machine, on_each_node=True):  # the default of distributed()
        accel.save(state, tmp_path / "option.safetensors")
        accel.save(state, tmp_path / "off.pt", on_each_node=False)  # the argument wins
    with fake_state(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                    num_nodes=2, on_each_node=True):
        accel.save(state, tmp_path / "not_local_main.pt")
        with pytest.raises(CheckpointError, match="under 'x' is of type int"):
            accel.save({"x": 1}, tmp_path / "bad.safetensors")  # checked on every rank
    written = [n for n in _entries(tmp_path) if not n.endswith(".accel-lock")]
    assert written == ["each.pt", "each_export", "option.safetensors"]
    assert _equal(torch.load(tmp_path / "each.pt"), state)
    fresh = _model(1)
    accel.load_checkpoint_in_model(fresh, tmp_path / "each_export", strict=True)
    assert _equal(fresh.state_dict(), state)


def test_on_each_node_option_config_key_and_variable(tmp_path: Path) -> None:
    with accel.distributed() as st:
        assert st.on_each_node is False
    with accel.distributed(on_each_node=True) as st:
        assert st.on_each_node is True
        with accel.distributed(mixed_precision="no") as inner:
            assert inner.on_each_node is True  # nested blocks keep it
        with accel.distributed(on_each_node=False) as inner:
            assert inner.on_each_node is False
    with (
        pytest.raises(ConfigError, match="on_each_node='yes'"),
        accel.distributed(on_each_node="yes"),  # type: ignore[arg-type]
    ):
        pass
    assert read_launch_env({"ACCEL_ON_EACH_NODE": "1"}).on_each_node is True
    assert read_launch_env({}).on_each_node is None
    with pytest.raises(ConfigError, match="ACCEL_ON_EACH_NODE"):
        read_launch_env({"ACCEL_ON_EACH_NODE": "sometimes"})
    assert parse_config("on_each_node = true") == {"on_each_node": True}
    with pytest.raises(ConfigError, match="on_each_node"):
        parse_config('on_each_node = "maybe"')


def test_config_file_and_environment_reach_distributed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text("on_each_node = true\n")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    with accel.distributed() as st:
        assert st.on_each_node is True
    monkeypatch.setenv("ACCEL_ON_EACH_NODE", "0")  # the environment wins over the file
    with accel.distributed() as st:
        assert st.on_each_node is False


def test_single_process_save_state_with_on_each_node_is_a_normal_checkpoint(
    tmp_path: Path,
) -> None:
    model = _model()
    with accel.distributed(on_each_node=True):
        path = accel.save_state(tmp_path, step=1, model=model)
        fresh = _model(1)
        info = accel.load_state(tmp_path, model=fresh)
    assert info is not None and info.step == 1
    assert _equal(fresh.state_dict(), model.state_dict())
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["ranks"] == [0] and isinstance(manifest["save_id"], str)


def test_manifest_ranks_and_save_id_are_validated(tmp_path: Path) -> None:
    model = _model()
    path = accel.save_state(tmp_path / "ckpt", model=model)
    manifest = json.loads((path / "manifest.json").read_text())
    for field, bad in (("ranks", [0, "1"]), ("ranks", [5]), ("save_id", 7)):
        broken = {**manifest, field: bad}
        (path / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=f"'{field}' is"):
            accel.load_state(path, model=_model(1))


# --- docs/checkpoints.md: Accelerate's save/load state hooks, ported -----------------------


def test_hooks_example_of_the_docs_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = DOCS.read_text()
    assert DOC_MARKER in text
    block = text.split(DOC_MARKER, 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    # the block's own asserts check the round trip
    exec(compile(block, str(DOCS), "exec", dont_inherit=True), namespace)
    saved = tmp_path / "ckpt" / "checkpoint_3"
    adapter = safetensors.torch.load_file(str(saved / "adapter.safetensors"))
    assert sorted(adapter) == ["lora_a", "lora_b"]  # the frozen base weights are not saved
    model = accel.unwrap_model(namespace["model"])
    assert torch.equal(adapter["lora_b"], model.lora_b.detach())
    assert json.loads((saved / "config.json").read_text())["state"] == {
        "lr": 0.01, "notes": "adapter only"}
    # a wrapper over another model refuses the checkpoint before anything changes
    other = namespace["LoRALinear"](8, rank=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="adapter"):
        accel.load_state(tmp_path / "ckpt", adapter=namespace["AdapterWeights"](other))
    assert _equal(other.state_dict(), before)
