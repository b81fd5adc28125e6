"""dispatch_model, cpu_offload, disk_offload, remove_hooks: outputs equal to the plain model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from accel.big_model.dispatch import cpu_offload, disk_offload, dispatch_model, remove_hooks
from accel.errors import DeviceMapError

# On the CPU the dispatched model runs the same kernels as the reference; where accel's device is
# a GPU, its kernels sum in another order (differences of a few ulps of the logits).
ATOL, RTOL = (1e-6, 0.0) if not torch.cuda.is_available() else (1e-5, 1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor | None = None) -> torch.Tensor:
        y = self.norm(x + self.inner(x))
        return y if shift is None else y + shift


class Net(nn.Module):
    """Embedding, nested blocks, a head tied to the embedding, a buffer, dict/tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Module()
        self.scale.register_buffer("factor", torch.tensor([1.5]))

    def forward(self, ids: torch.Tensor, shift: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.embed(ids)
        hidden = []
        for block in self.blocks:
            x = block(x, shift=shift)
            hidden.append(x)
        return {"logits": self.head(x) * self.scale.factor, "hidden": tuple(hidden)}


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (2, 5), generator=gen), torch.randn(8, generator=gen)


def _assert_same(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert set(out) == set(ref)
    torch.testing.assert_close(out["logits"], ref["logits"], atol=ATOL, rtol=RTOL)
    assert isinstance(out["hidden"], tuple) and len(out["hidden"]) == len(ref["hidden"])
    for a, b in zip(out["hidden"], ref["hidden"], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def _reference(model: nn.Module) -> dict[str, Any]:
    ids, shift = _inputs()
    with torch.no_grad():
        return model(ids, shift=shift)  # type: ignore[no-any-return]


def _run(model: nn.Module) -> dict[str, Any]:
    ids, shift = _inputs()
    with torch.no_grad():
        return model(ids, shift=shift)  # type: ignore[no-any-return]


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_hooks)
        for m in model.modules()
    )


MIXED = {
    "embed": "cpu",
    "blocks.0": "disk",
    "blocks.1": "cpu",
    "blocks.2.inner": "disk",
    "blocks.2.norm": "cpu",
    "head": "disk",
    "scale": "cpu",
}


def test_mixed_cpu_and_disk_map(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, MIXED, offload_dir=tmp_path)
    assert model.hf_device_map == MIXED  # type: ignore[comparison-overlap]
    assert model.blocks[0].inner[0].weight.device.type == "meta"
    assert model.blocks[2].inner[2].bias.device.type == "meta"
    assert model.blocks[1].inner[0].weight.device.type == "cpu"  # no GPU: cpu runs in place
    assert model.blocks[2].norm.weight.device.type == "cpu"
    _assert_same(_run(model), ref)
    _assert_same(_run(model), ref)  # the second forward reads the file again
    assert model.blocks[0].inner[0].weight.device.type == "meta"  # released after forward


def test_all_disk(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.scale.factor.device.type == "cpu"  # buffers stay on the execution device
    _assert_same(_run(model), ref)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_offload_file_is_safetensors_and_tied_weight_written_once(tmp_path: Path) -> None:
    model = _net()
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["accel-offload.safetensors"]
    raw = (tmp_path / files[0]).read_bytes()
    assert not raw.startswith((b"\x80", b"PK"))  # not a pickle, not a torch zip
    with safe_open(tmp_path / files[0], framework="pt") as f:
        keys = set(f.keys())
    names = {n for n, _ in _net().named_parameters()}  # tied: one name for both
    assert keys == names and "head.weight" not in keys


def test_tied_weight_stays_shared(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    assert model.head.weight is model.embed.weight
    seen: list[str] = []  # pre hooks added after dispatch run after accel's: weights loaded
    model.head.register_forward_pre_hook(lambda m, a: seen.append(m.weight.device.type))
    _assert_same(_run(model), ref)
    assert seen == ["cpu"]  # loaded for the head's own forward
    assert model.head.weight is model.embed.weight
    remove_hooks(model)
    assert model.head.weight is model.embed.weight
    _assert_same(_run(model), ref)


def test_tied_weight_split_across_cpu_and_disk(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, MIXED, offload_dir=tmp_path)  # embed on cpu, head on disk
    assert model.head.weight is model.embed.weight  # kept where embed runs, shared
    with safe_open(tmp_path / "accel-offload.safetensors", framework="pt") as f:
        assert "embed.weight" not in set(f.keys())
    _assert_same(_run(model), ref)


def test_weights_are_real_during_forward_and_meta_after(tmp_path: Path) -> None:
    model = _net()
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    during: list[str] = []
    layer = model.blocks[1].inner[0]
    layer.register_forward_pre_hook(lambda m, a: during.append(m.weight.device.type))
    _run(model)
    assert during == ["cpu"]
    assert layer.weight.device.type == "meta"


def test_forward_that_raises_releases_weights(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    with pytest.raises(IndexError):
        model(torch.tensor([[99]]))  # out of the embedding's range
    assert all(p.device.type == "meta" for p in model.parameters())
    _assert_same(_run(model), ref)


def test_cpu_offload_matches_plain_model() -> None:
    model = _net()
    ref = _reference(model)
    cpu_offload(model, execution_device="cpu")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not hasattr(model, "hf_device_map")
    _assert_same(_run(model), ref)
    remove_hooks(model)
    assert all(p.device.type == "cpu" for p in model.parameters())
    _assert_same(_run(model), ref)


def test_cpu_offload_default_execution_device_is_accels_device() -> None:
    model = _net()
    ref = _reference(model)
    cpu_offload(model)  # CPU here; this process's GPU where there is one
    out = _run(model)
    assert out["logits"].device.type == "cpu"
    _assert_same(out, ref)


def test_disk_offload_matches_plain_model(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    disk_offload(model, tmp_path / "new" / "folder")
    assert (tmp_path / "new" / "folder" / "accel-offload.safetensors").is_file()
    _assert_same(_run(model), ref)


def test_kwargs_and_positional_inputs(tmp_path: Path) -> None:
    model = _net()
    ids, shift = _inputs()
    with torch.no_grad():
        ref_kw = model(ids=ids, shift=shift)
        ref_pos = model(ids, shift)
    dispatch_model(model, MIXED, offload_dir=tmp_path)
    with torch.no_grad():
        _assert_same(model(ids=ids, shift=shift), ref_kw)
        _assert_same(model(ids, shift), ref_pos)


def test_state_dict_returns_real_values(tmp_path: Path) -> None:
    model = _net()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    dispatch_model(model, MIXED, offload_dir=tmp_path)
    got = model.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].device.type == "cpu", key
        torch.testing.assert_close(got[key], value, atol=0, rtol=0)


def test_eval_no_grad_and_grad_mode(tmp_path: Path) -> None:
    model = _net()
    ids, shift = _inputs()
    ref = model(ids, shift=shift)["logits"].detach()
    dispatch_model(model, MIXED, offload_dir=tmp_path).eval()
    assert not model.training and not model.blocks[0].training
    with torch.no_grad():
        torch.testing.assert_close(model(ids, shift=shift)["logits"], ref, atol=ATOL, rtol=RTOL)
    out = model(ids, shift=shift)["logits"]  # grad mode: still runs, output has a graph
    assert out.requires_grad
    torch.testing.assert_close(out.detach(), ref, atol=ATOL, rtol=RTOL)


def test_remove_hooks_restores_a_plain_module(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    hooks_before = _hook_count(model)
    dispatch_model(model, MIXED, offload_dir=tmp_path)
    assert _hook_count(model) > hooks_before
    assert remove_hooks(model) is model
    assert _hook_count(model) == hooks_before
    assert not hasattr(model, "hf_device_map")
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.head.weight is model.embed.weight
    _assert_same(_run(model), ref)
    # the weights are the model's own now: deleting the offload folder changes nothing
    for path in tmp_path.iterdir():
        path.unlink()
    _assert_same(_run(model), ref)


def test_remove_hooks_on_plain_model_is_a_no_op() -> None:
    model = _net()
    ref = _reference(model)
    assert remove_hooks(model) is model
    _assert_same(_run(model), ref)


def test_dispatch_twice_replaces_hooks(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, MIXED, offload_dir=tmp_path)
    count = _hook_count(model)
    dispatch_model(model, MIXED, offload_dir=tmp_path)
    assert _hook_count(model) == count
    _assert_same(_run(model), ref)
    # another map: the disk weights come from the previous dispatch's file, not copied
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path / "second")
    assert model.hf_device_map == {"": "disk"}  # type: ignore[comparison-overlap]
    _assert_same(_run(model), ref)
    cpu_offload(model, execution_device="cpu")
    _assert_same(_run(model), ref)
    dispatch_model(model, {"": "cpu"})
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.head.weight is model.embed.weight
    _assert_same(_run(model), ref)
    remove_hooks(model)
    assert _hook_count(model) == 0
    _assert_same(_run(model), ref)


def test_redispatch_keeps_mapped_weights_without_offload_dir(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    dispatch_model(model, {"": "disk"})  # everything already has a file: nothing to write
    _assert_same(_run(model), ref)


def test_single_device_map_adds_no_forward_hooks() -> None:
    model = _net()
    ref = _reference(model)
    dispatch_model(model, {"": "cpu"})
    assert model.hf_device_map == {"": "cpu"}  # type: ignore[comparison-overlap]
    assert all(not m._forward_pre_hooks for m in model.modules())
    _assert_same(_run(model), ref)


def test_missing_offload_dir_is_an_error() -> None:
    model = _net()
    with pytest.raises(DeviceMapError, match=r"\['blocks'\] on 'disk', but offload_dir is None"):
        dispatch_model(model, {"embed": "cpu", "blocks": "disk", "head": "cpu", "scale": "cpu"})
    assert model.blocks[0].inner[0].weight.device.type == "cpu"  # nothing changed
    assert not hasattr(model, "hf_device_map")


def test_offload_dir_that_is_a_file_is_an_error(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(DeviceMapError, match="is a file"):
        dispatch_model(_net(), {"": "disk"}, offload_dir=file)
    with pytest.raises(DeviceMapError, match="is a file"):
        disk_offload(_net(), file)


def test_disk_offload_without_folder_is_an_error() -> None:
    with pytest.raises(DeviceMapError, match="offload_dir is None"):
        disk_offload(_net(), None)  # type: ignore[arg-type]


def test_bad_execution_device_is_an_error() -> None:
    with pytest.raises(DeviceMapError, match="'disk'"):
        cpu_offload(_net(), execution_device="disk")


def test_meta_weights_without_source_are_an_error(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(DeviceMapError, match=r"'0\.weight' is on the meta device"):
        dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)


def test_bad_preload_class_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DeviceMapError, match="preload_module_classes"):
        dispatch_model(_net(), {"": "disk"}, offload_dir=tmp_path, preload_module_classes=[3])  # type: ignore[list-item]


def test_offload_buffers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model(torch.randn(16, 4))  # running statistics that are not the defaults
    model.eval()
    x = torch.randn(3, 4)
    ref = model(x).detach()
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path, offload_buffers=True)
    assert model[1].running_mean.device.type == "meta"
    torch.testing.assert_close(model(x).detach(), ref, atol=ATOL, rtol=RTOL)
    assert model[1].running_mean.device.type == "meta"
    with safe_open(tmp_path / "accel-offload.safetensors", framework="pt") as f:
        assert {"1.running_mean", "1.running_var"} <= set(f.keys())
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)  # default: buffers stay put
    assert model[1].running_mean.device.type == "cpu"
    torch.testing.assert_close(model(x).detach(), ref, atol=ATOL, rtol=RTOL)


class UsesChildWeight(nn.Module):
    """Reads its child's weight without calling the child (needs preloading)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.T + self.proj.bias


def test_preload_module_classes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(UsesChildWeight(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    ref = model(x).detach()
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    with pytest.raises(RuntimeError):  # the child's weight is still on meta
        model(x)
    assert model[1].weight.device.type == "meta"  # nothing left loaded by the failed forward
    dispatch_model(
        model, {"": "disk"}, offload_dir=tmp_path, preload_module_classes=["UsesChildWeight"]
    )
    torch.testing.assert_close(model(x).detach(), ref, atol=ATOL, rtol=RTOL)
    dispatch_model(
        model, {"": "disk"}, offload_dir=tmp_path, preload_module_classes=[UsesChildWeight]
    )
    torch.testing.assert_close(model(x).detach(), ref, atol=ATOL, rtol=RTOL)


def test_multihead_attention_is_preloaded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    model.eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        ref = model(x)
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, atol=ATOL, rtol=RTOL)


def test_shared_submodule_under_two_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(2, 4)
    ref = model(x).detach()
    dispatch_model(model, {"0": "disk", "1": "cpu", "2": "disk"}, offload_dir=tmp_path)
    torch.testing.assert_close(model(x).detach(), ref, atol=ATOL, rtol=RTOL)
    assert model[0].weight.device.type == "meta"


def test_recursive_call_of_one_module(tmp_path: Path) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
            y = self.lin(x)
            return y if depth else self(y, depth=1) + self.lin.weight.sum()

    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(2, 4)
    ref = model(x).detach()
    disk_offload(model, tmp_path, execution_device="cpu", preload_module_classes=[Twice])
    torch.testing.assert_close(model(x).detach(), ref, atol=ATOL, rtol=RTOL)
    assert model.lin.weight.device.type == "meta"


def test_deepcopy_of_plain_model_after_remove(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    disk_offload(model, tmp_path)
    copied = copy.deepcopy(remove_hooks(model))
    _assert_same(_run(copied), ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_map_with_cpu_and_disk(tmp_path: Path) -> None:
    model = _net()
    ref = _reference(model)
    device_map = {**MIXED, "embed": 0, "blocks.1": 0}
    dispatch_model(model, device_map, offload_dir=tmp_path)
    assert model.embed.weight.device.type == "cuda"
    assert model.blocks[2].norm.weight.device.type == "meta"  # "cpu" is offloaded with a GPU
    out = _run(model)
    assert out["logits"].device.type == "cpu"  # back on the input's device
    _assert_same(out, ref)
    ids, shift = _inputs()
    with torch.no_grad():
        on_gpu = model(ids.cuda(), shift=shift.cuda())
    assert on_gpu["logits"].device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_cpu_offload_and_disk_offload(tmp_path: Path) -> None:
    for offload in (
        lambda m: cpu_offload(m, execution_device=0),
        lambda m: disk_offload(m, tmp_path, execution_device=0),
    ):
        model = _net()
        ref = _reference(model)
        offload(model)
        seen: list[str] = []

        def record(module: nn.Module, args: Any, seen: list[str] = seen) -> None:
            seen.append(module.weight.device.type)

        model.blocks[0].inner[0].register_forward_pre_hook(record)
        out = _run(model)
        assert seen == ["cuda"] and out["logits"].device.type == "cpu"
        _assert_same(out, ref)
