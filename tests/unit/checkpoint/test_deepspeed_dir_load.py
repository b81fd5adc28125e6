"""`accel.load_state` of DeepSpeed `save_checkpoint` directories, on hand-written directories.

The files are written here with `torch.save` in DeepSpeed's layout (no DeepSpeed needed): two
ranks' ZeRO-2 partitions of one 4-value parameter, the last rank's optimizer state ending in
the group's padding. Checked: the weights and Adam's state are put back together in order (the
padding dropped), the hyper-parameters and step follow, objects the directory holds nothing for
are named in one warning; and what cannot be resumed raises `CheckpointError` saying what to do
(ZeRO-0's optimizer, a state that is not one value per weight, another kind of optimizer, two
models). Real DeepSpeed runs: tests/multiproc/test_deepspeed_dir_resume.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.checkpoint._from_deepspeed import DeepSpeedCheckpointInfo
from accel.errors import CheckpointError


class _Counter:
    def state_dict(self) -> dict[str, int]:
        return {"n": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise AssertionError("not restored from a DeepSpeed directory")


class _One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))
        self.register_buffer("count", torch.tensor([7.0]))


def _group(**extra: Any) -> dict[str, Any]:
    return {"lr": 0.25, "betas": (0.5, 0.75), "eps": 1e-6, "weight_decay": 0.125,
            "amsgrad": False, "params": [0], **extra}


def _write(root: Path, *, stage: int = 2, state: dict[int, dict[str, Any]] | None = None,
           group: dict[str, Any] | None = None, optimizer: Any = None) -> Path:
    """A DeepSpeed directory of `_One` saved by 2 ranks (ZeRO-2) or 1 (ZeRO-0)."""
    tag = root / "global_step3"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step3")
    module = {"w": torch.zeros(4), "count": torch.tensor([7.0])}
    torch.save({"module": module, "buffer_names": ["count"], "optimizer": optimizer,
                "param_shapes": [{"w": (4,)}] if stage else None, "shared_params": {},
                "lr_scheduler": None, "global_steps": 3, "global_samples": 24,
                "skipped_steps": 0, "dp_world_size": 2, "mp_world_size": 1,
                "ds_config": {"zero_optimization": {"stage": stage}}, "ds_version": "0.19.8",
                "my_counter": 5},  # the script's client_state
               tag / "mp_rank_00_model_states.pt")
    if not stage:
        return root
    masters = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    for rank in range(2):
        own = state[rank] if state is not None else {
            "step": torch.tensor(3.0),
            "exp_avg": torch.tensor([10.0, 20.0] if rank == 0 else [30.0, 40.0, 99.0]),
            "exp_avg_sq": torch.tensor([0.1, 0.2] if rank == 0 else [0.3, 0.4, 99.0]),
        }
        base = {"state": {0: own}, "param_groups": [group or _group()]}
        torch.save({"optimizer_state_dict": {
            "zero_stage": stage, "partition_count": 2, "base_optimizer_state": base,
            "single_partition_of_fp32_groups": [masters[rank]],
            "group_paddings": [0 if rank == 0 else 1], "param_alignment_paddings": [[0]],
        }}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return root


def test_weights_and_adam_state_are_reassembled_padding_dropped(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds")
    model = _One()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    with accel.distributed(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = accel.load_state(root, model=model, optimizer=optimizer, other=_Counter())
    assert isinstance(info, DeepSpeedCheckpointInfo)
    assert (info.step, info.zero_stage, info.world_size, info.global_samples) == (3, 2, 2, 24)
    assert info.path == root / "global_step3" and info.objects == ("model", "optimizer")
    assert torch.equal(model.w.detach(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    saved = optimizer.state[model.w]
    assert torch.equal(saved["exp_avg"], torch.tensor([10.0, 20.0, 30.0, 40.0]))
    assert torch.allclose(saved["exp_avg_sq"], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert float(saved["step"]) == 3.0
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.25, (0.5, 0.75), 0.125)
    assert "maximize" in group  # the live optimizer's own hyper-parameters are kept
    optimizer.step()  # a torch AdamW steps on the restored state
    messages = [str(w.message) for w in caught if "DeepSpeed" in str(w.message)]
    assert len(messages) == 1, messages
    for part in ("other=", "RNG states", "my_counter", "global_step3"):
        assert part in messages[0], messages[0]


def test_the_tag_directory_itself_loads_and_a_model_alone(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds")
    model = _One()
    with accel.distributed(), pytest.warns(UserWarning, match="not restored"):
        info = accel.load_state(root / "global_step3", model=model)
    assert info is not None and info.objects == ("model",)
    assert torch.equal(model.w.detach(), torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_zero0_weights_load_its_optimizer_is_refused(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds", stage=0, optimizer={"state": {}, "param_groups": []})
    model = _One()
    with accel.distributed(), pytest.warns(UserWarning, match="not restored"):
        accel.load_state(root, model=model)
    with accel.distributed(), pytest.raises(CheckpointError, match="stage 0") as raised:
        accel.load_state(root, model=_One(), optimizer=torch.optim.AdamW(model.parameters()))
    assert "accel merge-weights" in str(raised.value)


def test_state_that_is_not_one_value_per_weight_is_refused(tmp_path: Path) -> None:
    state = {r: {"step": torch.tensor(1.0), "row": torch.ones(5)} for r in range(2)}
    root = _write(tmp_path / "ds", state=state)
    model = _One()
    with accel.distributed(), pytest.raises(CheckpointError, match="not Adam-like") as raised:
        accel.load_state(root, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert "accel merge-weights" in str(raised.value)
    assert torch.equal(model.w.detach(), torch.zeros(4))  # nothing changed


def test_another_kind_of_optimizer_is_refused(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds")
    model = _One()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with accel.distributed(), pytest.raises(CheckpointError, match="another kind"):
        accel.load_state(root, model=model, optimizer=sgd)
    assert torch.equal(model.w.detach(), torch.zeros(4))


def test_two_models_are_refused(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds")
    with accel.distributed(), pytest.raises(CheckpointError, match="holds one model"):
        accel.load_state(root, model=_One(), second=_One())
