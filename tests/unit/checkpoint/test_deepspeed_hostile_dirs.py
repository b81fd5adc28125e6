"""DeepSpeed `save_checkpoint` directories as hostile input, read with accel's own rules.

The directories are written here with `torch.save` in DeepSpeed's layout (no DeepSpeed needed):
two ranks' ZeRO-2 partitions of one 4-value parameter. Checked, for `accel.load_state`,
`accel merge-weights` and `accel checkpoint inspect`/`verify`:

* no link is followed anywhere inside: a shard file (model or optimizer states), the tag's
  directory or the `latest` file that is a symbolic link to a file outside is refused with a
  CheckpointError naming the link and its target (inspect/verify report it as a problem);
* a shard of stride-0 views (`torch.zeros(1).expand(2**30)`: a 4 GiB tensor in a few KB) is
  refused before anything is allocated: the pickle screen charges each tensor its full logical
  size. These run in one child process bounded in address space (`RLIMIT_AS`) and in the size
  of the files it may write (`RLIMIT_FSIZE`), so a regression fails instead of eating the host;
* the screen itself (it builds no tensor, so it runs here): stride-0 views in other forms
  (`as_strided`, a dtype `_rebuild_tensor_v3` writes, a Parameter, 512 small views) in both of
  torch's formats are refused; honest views of one storage and tied names pass.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.cli.main import main
from accel.errors import CheckpointError
from tests.unit.checkpoint._bounded_child import run_cases

TAG = "global_step3"


class _One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))
        self.register_buffer("count", torch.tensor([7.0]))


def _write(root: Path, *, module_w: torch.Tensor | None = None,
           masters: list[torch.Tensor] | None = None, stage: int = 2) -> Path:
    """A DeepSpeed directory of `_One` (`w` of `module_w`'s shape) saved by 2 ranks."""
    tag = root / TAG
    tag.mkdir(parents=True)
    (root / "latest").write_text(TAG)
    w = torch.zeros(4) if module_w is None else module_w
    torch.save({"module": {"w": w, "count": torch.tensor([7.0])}, "buffer_names": ["count"],
                "param_shapes": [{"w": tuple(w.shape)}] if stage else None,
                "shared_params": {}, "lr_scheduler": None, "global_steps": 3,
                "dp_world_size": 2, "mp_world_size": 1,
                "ds_config": {"zero_optimization": {"stage": stage}}, "ds_version": "0.19.8"},
               tag / "mp_rank_00_model_states.pt")
    if not stage:
        return root
    masters = masters or [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    for rank, master in enumerate(masters):
        own = {"step": torch.tensor(3.0), "exp_avg": master, "exp_avg_sq": master}
        base = {"state": {0: own}, "param_groups": [{"lr": 0.25, "betas": (0.5, 0.75),
                                                     "eps": 1e-6, "weight_decay": 0.0,
                                                     "amsgrad": False, "params": [0]}]}
        torch.save({"optimizer_state_dict": {
            "zero_stage": stage, "partition_count": 2, "base_optimizer_state": base,
            "single_partition_of_fp32_groups": [master], "group_paddings": [0],
            "param_alignment_paddings": [[0]],
        }}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return root


def _link_out(link: Path, outside: Path) -> Path:
    """Move ``link`` to ``outside`` and put a symbolic link to it in its place."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(link, outside)
    link.symlink_to(outside)
    return outside


LINKS = {
    "optimizer shard": lambda root, out: _link_out(
        root / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt", out / "optim.pt"),
    "model shard": lambda root, out: _link_out(
        root / TAG / "mp_rank_00_model_states.pt", out / "model.pt"),
    "tag directory": lambda root, out: _link_out(root / TAG, out / TAG),
    "latest file": lambda root, out: _link_out(root / "latest", out / "latest"),
}


@pytest.mark.parametrize("what", list(LINKS))
def test_a_link_inside_is_refused_by_load_merge_and_inspect(
    tmp_path: Path, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write(tmp_path / "ds")
    target = LINKS[what](root, tmp_path / "elsewhere")
    named = ("symbolic link", os.fspath(target))

    model = _One()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    with accel.distributed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError) as raised:
            accel.load_state(root, model=model, optimizer=optimizer)
    assert all(part in str(raised.value) for part in named), str(raised.value)
    assert torch.equal(model.w.detach(), torch.zeros(4)) and not optimizer.state

    out = tmp_path / "merged"
    assert main(["merge-weights", os.fspath(root), os.fspath(out)]) == 2
    err = capsys.readouterr().err
    assert all(part in err for part in named), err
    assert not out.exists()

    assert main(["checkpoint", "inspect", os.fspath(root), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any(all(part in p for part in named) for p in problems), problems
    assert main(["checkpoint", "verify", os.fspath(root)]) == 1
    assert "symbolic link" in capsys.readouterr().out


def test_an_unread_link_in_a_tag_is_reported_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write(tmp_path / "ds")
    outside = tmp_path / "elsewhere.pt"
    torch.save({"x": torch.ones(2)}, outside)
    (root / TAG / "extra.pt").symlink_to(outside)
    assert main(["checkpoint", "inspect", os.fspath(root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("extra.pt" in p and "symbolic link" in p for p in report["problems"]), report
    status = {f["name"]: f["status"] for f in report["files"]}
    assert "symbolic link" in status["extra.pt"], status


def test_an_honest_directory_still_loads_merges_and_inspects_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write(tmp_path / "ds")
    model = _One()
    with accel.distributed(), pytest.warns(UserWarning, match="not restored"):
        accel.load_state(root, model=model)
    assert torch.equal(model.w.detach(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert main(["merge-weights", os.fspath(root), os.fspath(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "inspect", os.fspath(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []


_BOUNDED = textwrap.dedent(
    """
    import contextlib, io, json, resource, signal, sys, warnings
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails with EFBIG
    import torch
    from torch import nn
    import accel
    from accel.cli.main import main
    warnings.simplefilter("ignore")

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))
            self.register_buffer("count", torch.tensor([7.0]))

    for name, (op, path, out) in json.loads(sys.argv[1]).items():
        try:
            if op.startswith("load"):
                model = One()
                objects = {"model": model}
                if op == "load":  # ZeRO 1-3: with the optimizer (ZeRO-0 keeps none)
                    objects["optimizer"] = torch.optim.AdamW(model.parameters())
                with accel.distributed():
                    accel.load_state(path, **objects)
                outcome = ["OK", ""]
            else:
                text = io.StringIO()
                with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                    args = {"merge": ["merge-weights", path, out],
                            "inspect": ["checkpoint", "inspect", path, "--json"],
                            "verify": ["checkpoint", "verify", path]}[op]
                    code = main(args)
                outcome = [f"exit {code}", text.getvalue()]
        except BaseException as exc:
            outcome = [type(exc).__name__, str(exc)[-2000:]]
        print(json.dumps({name: outcome}), flush=True)
    """
)


def _bounded(cases: dict[str, tuple[str, str, str]], timeout: float = 120) -> dict[str, Any]:
    """Run each ``name: (op, path, out)`` in one bounded child; ``[outcome, message]`` each."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    return run_cases(_BOUNDED, cases, timeout=timeout, env=env,
                     what="a hostile DeepSpeed directory")


@pytest.mark.slow  # one child process importing torch (~4 s on 2 idle cores)
@pytest.mark.ci_extra
def test_stride_zero_views_are_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    huge = torch.zeros(1).expand(2**30)  # 4 GiB of float32 from one stored value
    zero0 = _write(tmp_path / "zero0", module_w=huge, stage=0)
    # ZeRO-2: the module's weight is a small placeholder; each rank's fp32 partition (and
    # Adam's state over it) is the view, of 2**30 values each, as param_shapes says
    zero2 = _write(tmp_path / "zero2", masters=[huge, huge])
    model_file = zero2 / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, weights_only=True)
    state["param_shapes"] = [{"w": (2**31,)}]
    torch.save(state, model_file)
    roots = {"zero-0 module weight": zero0, "zero-2 fp32 partitions": zero2}
    assert all(f.stat().st_size < 64 << 10 for r in roots.values() for f in (r / TAG).iterdir())
    cases: dict[str, tuple[str, str, str]] = {}
    for label, root in roots.items():
        for op in ("load-model" if root == zero0 else "load", "merge", "inspect", "verify"):
            out = os.fspath(tmp_path / f"out{len(cases)}")
            cases[f"{op}: {label}"] = (op, os.fspath(root), out)
    results = _bounded(cases)
    for name, (outcome, message) in results.items():
        op = name.split(":")[0]
        expected = {"load": "CheckpointError", "load-model": "CheckpointError",
                    "merge": "exit 2", "inspect": "exit 1", "verify": "exit 1"}[op]
        assert outcome == expected, (name, outcome, message)
        assert "logical size" in message and "_states.pt" in message, (name, message)
    for index, (op, _, out) in enumerate(cases.values()):
        assert op != "merge" or not Path(out).exists(), (index, out)


def _views() -> dict[str, Any]:
    one = torch.zeros(1)
    return {
        "expand, float32": {"w": one.expand(2**30)},
        "expand, a dtype of _rebuild_tensor_v3": {
            "w": torch.zeros(1, dtype=torch.float8_e4m3fn).expand(2**33)},
        "as_strided, stride 0 in 2-D": {"w": one.as_strided((2**15, 2**15), (0, 0))},
        "a Parameter of an expanded view": {
            "w": nn.Parameter(one.expand(2**30), requires_grad=False)},
        "many small views of one value": {f"w{i}": one.expand(2**20) for i in range(512)},
    }


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "before zip"])
@pytest.mark.parametrize("name", list(_views()))
def test_the_screen_charges_each_tensor_its_logical_size(
    tmp_path: Path, name: str, legacy: bool
) -> None:
    from accel._files.torch_zip import opened_torch_file  # checks; builds no tensor

    if legacy and "rebuild_tensor_v3" in name:
        pytest.skip("torch's format before zip has no storage for float8")
    path = tmp_path / "views.pt"
    torch.save(_views()[name], path, _use_new_zipfile_serialization=not legacy)
    assert path.stat().st_size < 1 << 20
    with (pytest.raises(CheckpointError, match="full logical size") as raised,
          opened_torch_file(path, follow_links=False)):
        pass
    assert os.fspath(path) in str(raised.value) and "`tensor.contiguous()`" in str(raised.value)


def test_honest_views_and_ties_pass_the_screen(tmp_path: Path) -> None:
    from accel._files.torch_zip import opened_torch_file

    flat = torch.arange(2**18, dtype=torch.float32)  # 1 MiB, cut into views as ZeRO's buffers
    tied = flat[: 2**16].view(2**8, 2**8)
    state = {"a": flat[: 2**16], "b": flat[2**16 :], "wte": tied, "head": tied.detach(),
             "pos": torch.arange(8).expand(1, -1), "n": nn.Parameter(flat[:4].clone())}
    for legacy in (False, True):
        path = tmp_path / f"honest{legacy}.pt"
        torch.save(state, path, _use_new_zipfile_serialization=not legacy)
        with opened_torch_file(path, follow_links=False):
            pass
        loaded = torch.load(path, weights_only=True)
        assert torch.equal(loaded["b"], flat[2**16 :]) and loaded["pos"].shape == (1, 8)
