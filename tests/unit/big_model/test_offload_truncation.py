"""A file a dispatched model reads from disk, changed by another process, is a CheckpointError.

Disk-offloaded weights are read at each forward with ``pread`` from the file held open, never
through the memory map: touching a map past the new end of a truncated file kills the
process with SIGBUS. Each case runs in a child process, so a regression shows as a child
killed by a signal instead of taking the test run with it. Also: the read buffers a forward
reuses are never ones autograd (or the caller) still holds.
"""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import accel
from accel.big_model import offload
from accel.testing import run_script

_CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    from torch import nn
    import accel
    from accel.errors import CheckpointError

    case, root = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)

    def build():
        return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))

    model, x = build(), torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    if case in ("own", "grown", "remove_hooks"):  # dispatch_model writes accel's offload file
        live = accel.dispatch_model(model, {"": "disk"}, offload_dir=root / "off")
        target = root / "off" / "accel-offload.safetensors"
    elif case == "own_from_torch_file":  # a torch checkpoint: copied to the offload folder
        (root / "ckpt").mkdir()
        torch.save(model.state_dict(), root / "ckpt" / "pytorch_model.bin")
        with torch.device("meta"):
            live = build()
        accel.load_checkpoint_and_dispatch(
            live, root / "ckpt", device_map={"": "disk"}, offload_folder=root / "off"
        )
        target = root / "off" / "pytorch_model.bin.safetensors"
    else:  # "shard": a safetensors checkpoint, mapped where it is
        accel.save_model(model, root / "ckpt")
        with torch.device("meta"):
            live = build()
        accel.load_checkpoint_and_dispatch(live, root / "ckpt", device_map={"": "disk"})
        target = root / "ckpt" / "model.safetensors"
    assert target.is_file(), sorted(p.name for p in root.rglob("*"))
    with torch.no_grad():
        torch.testing.assert_close(live(x), expected)  # read once: pages are resident
    if case == "grown":
        with open(target, "ab") as f:
            f.write(bytes(4096))
    else:
        os.truncate(target, target.stat().st_size // 2)
    try:
        with torch.no_grad():
            if case == "remove_hooks":
                accel.remove_hooks(live)
            else:
                live(x)
    except CheckpointError as exc:
        print("REFUSED", exc)
    else:
        print("NO ERROR")
    """
)


def _run(case: str, root: Path) -> str:
    """The case as ``python child.py CASE ROOT``, forked from the warm workers (torch and
    accel imported once): its output, or a failure naming the signal that killed it."""
    child = root / "child.py"
    child.write_text(_CHILD)
    done = run_script(child, case, str(root), world_size=1, launch=False, cwd=root,
                      timeout=300, check=False)
    (code,) = done.exit_codes
    out = done.stdout[0] + done.stderr[0]
    if code < 0:
        pytest.fail(f"the child died by {signal.Signals(-code).name}: {out}")
    assert code == 0, out
    return out


@pytest.mark.parametrize("case", ["own", "own_from_torch_file", "shard", "grown", "remove_hooks"])
def test_a_changed_file_under_a_live_model_is_a_checkpoint_error(tmp_path: Path, case: str) -> None:
    out = _run(case, tmp_path)
    assert "REFUSED" in out and "changed while the model was using it" in out, out


def test_the_forward_reads_a_copy_not_the_map(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    accel.dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    at_rest = model.state_dict()["weight"]  # the lazy view of the map (what saving reads)
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr()))
    with torch.no_grad():
        model(torch.randn(1, 256))
    assert seen and seen[0] != at_rest.data_ptr()


def _layers(requires_grad: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    width = 1024  # 4 MiB weights: read buffers big enough to be kept for reuse
    ref = nn.Sequential(*[nn.Linear(width, width) for _ in range(3)])
    ref.requires_grad_(requires_grad)
    live = nn.Sequential(*[nn.Linear(width, width) for _ in range(3)])
    live.load_state_dict(ref.state_dict())
    live.requires_grad_(requires_grad)
    return ref, live


def test_read_buffers_autograd_holds_are_not_reused(tmp_path: Path) -> None:
    ref, live = _layers(requires_grad=True)
    accel.dispatch_model(live, {"": "disk"}, offload_dir=tmp_path)
    x = torch.randn(4, 1024, requires_grad=True)
    ref(x).square().sum().backward()
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    for _ in range(2):  # the second pass finds buffers given back by the first
        live(x).square().sum().backward()  # each layer's weight is kept for the backward
        torch.testing.assert_close(x.grad, expected)
        x.grad = None


def test_read_buffers_are_reused_between_forwards(tmp_path: Path) -> None:
    _, live = _layers(requires_grad=False)
    accel.dispatch_model(live, {"": "disk"}, offload_dir=tmp_path)
    pointers: list[int] = []
    for layer in live:
        layer.register_forward_pre_hook(lambda m, a: pointers.append(m.weight.data_ptr()))
    x = torch.randn(2, 1024)
    with torch.no_grad():
        live(x)
        live(x)
    if offload._COUNT is None:
        pytest.skip("this torch has no storage use count: buffers are never reused")
    assert len(set(pointers[3:])) < 3  # the second forward reused buffers of the first


def test_buffers_read_under_inference_mode_serve_a_forward_with_autograd(tmp_path: Path) -> None:
    ref, live = _layers(requires_grad=True)
    accel.dispatch_model(live, {"": "disk"}, offload_dir=tmp_path)
    x = torch.randn(4, 1024, requires_grad=True)
    with torch.inference_mode():
        torch.testing.assert_close(live(x.detach()), ref(x.detach()))
    ref(x).square().sum().backward()
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    live(x).square().sum().backward()
    torch.testing.assert_close(x.grad, expected)
