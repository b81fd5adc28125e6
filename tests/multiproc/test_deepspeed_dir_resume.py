"""`accel.load_state` resumes from DeepSpeed's own `save_checkpoint` directories.

A plain DeepSpeed script (`deepspeed.initialize`, no accel in its training) trains a tied
language model (`tests.tied_models.TiedLM`: head tied to the embedding, odd widths, so the
partitions are uneven) on 2 gloo processes for 2 steps, saves with `engine.save_checkpoint`,
and takes a third step, recording its loss and the weights after it. Once under ZeRO-2 (torch
AdamW, `parameter_alignment`: a padding after each parameter in the flat groups, a StepLR
the engine steps) and once under ZeRO-3 (AdamW, each parameter cut over the ranks), in the
same processes. `accel.load_state(DS_DIR, model=..., optimizer=..., scheduler=...)` then
resumes in one plain process (this one), in FSDP2 and DDP on 2 processes and under DeepSpeed
through accel: the same third step gives the same loss and weights within 1e-5.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel.checkpoint._from_deepspeed import DeepSpeedCheckpointInfo
from accel.errors import CheckpointError
from accel.testing import run_distributed
from tests.deepspeed_marks import DEEPSPEED
from tests.tied_models import GLOBAL_BATCH, loss_of, tokens, toy

pytestmark = DEEPSPEED

STEPS, LR = 2, 1e-2


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), weight_decay=0.1)


def _scheduler(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _deepspeed(root: str, stage: int) -> dict[str, Any]:
    """A plain DeepSpeed script: 2 steps, `save_checkpoint`, the third step."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    st = accel.state()
    os.environ["LOCAL_RANK"] = str(st.local_rank)  # what DeepSpeed's launcher sets
    # gloo reduces on the CPU: no shared-memory op (DeepSpeed would compile it, ~1 min)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    model = toy(seed=stage)
    optimizer = _optimizer(model.parameters())
    zero: dict[str, Any] = {"stage": stage}
    if stage == 2:
        zero["parameter_alignment"] = True
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // st.world_size,
              "gradient_accumulation_steps": 1, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config,
        lr_scheduler=_scheduler(optimizer) if stage == 2 else None)

    def step(index: int) -> float:
        loss = loss_of(engine, tokens(index, st.rank, st.world_size))
        engine.backward(loss)
        engine.step()
        return float(accel.reduce(loss.detach(), "mean"))

    for index in range(STEPS):
        step(index)
    engine.save_checkpoint(os.path.join(root, f"zero{stage}"))
    loss = step(STEPS)
    weights = {name: safe_get_full_fp32_param(param).detach().clone()
               for name, param in engine.module.named_parameters()}
    return {"loss": loss, "weights": weights}


def _produce(root: str) -> dict[str, Any]:
    return {"zero2": _deepspeed(root, 2), "zero3": _deepspeed(root, 3)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dsdir")
    result = run_distributed(_produce, str(root), world_size=2, timeout=180)[0]
    return {"root": root, **result}


def _resume(path: str, scheduler: bool) -> dict[str, Any]:
    """`load_state` of DeepSpeed's directory, then the third step, under this block's engine."""
    st = accel.state()
    model = toy(seed=99)  # other weights: all come from the checkpoint
    optimizer = _optimizer(model.parameters())
    rows: Any = torch.cat([tokens(i) for i in range(STEPS + 1)])  # a dataset of rows
    loader: DataLoader[Any] = DataLoader(rows, batch_size=GLOBAL_BATCH // st.world_size)
    objects: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if scheduler:
        objects["scheduler"] = _scheduler(optimizer)
    prepared = accel.prepare(*objects.values(), loader)
    objects = dict(zip(objects, prepared[:-1], strict=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = accel.load_state(path, **objects)
    model, optimizer = objects["model"], objects["optimizer"]
    loss = loss_of(model, tokens(STEPS, st.rank, st.world_size))
    accel.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    told = [str(w.message) for w in caught if "DeepSpeed's checkpoint" in str(w.message)]
    return {"loss": float(accel.reduce(loss.detach(), "mean")), "info": info, "told": told,
            "weights": {k: v.float() for k, v in accel.get_state_dict(model).items()},
            "last_lr": objects["scheduler"].get_last_lr() if scheduler else None}


def _same_next_step(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert abs(got["loss"] - expected["loss"]) < 1e-5, (got["loss"], expected["loss"])
    for name, value in expected["weights"].items():
        assert torch.allclose(got["weights"][name], value, rtol=0, atol=1e-5), name
    assert torch.equal(got["weights"]["head.weight"], got["weights"]["embed.weight"])
    assert len(got["told"]) == 1 and "RNG states" in got["told"][0], got["told"]


@pytest.mark.ci_extra
def test_zero2_resumes_in_one_plain_process(saved: dict[str, Any]) -> None:
    with accel.distributed():
        got = _resume(str(saved["root"] / "zero2"), scheduler=True)
    _same_next_step(got, saved["zero2"])
    info = got["info"]
    assert isinstance(info, DeepSpeedCheckpointInfo)
    assert (info.step, info.zero_stage, info.world_size) == (STEPS, 2, 2)
    assert info.objects == ("model", "optimizer", "scheduler")
    assert got["last_lr"] == [LR * 0.5**STEPS]  # the engine stepped its StepLR twice


def test_zero3_resumes_in_one_plain_process(saved: dict[str, Any]) -> None:
    with accel.distributed():
        got = _resume(str(saved["root"] / "zero3"), scheduler=False)
    _same_next_step(got, saved["zero3"])
    assert got["info"].zero_stage == 3


@pytest.mark.slow
def test_zero2_resumes_under_fsdp2_on_2_processes(saved: dict[str, Any]) -> None:
    got = run_distributed(_resume, str(saved["root"] / "zero2"), True, world_size=2,
                          timeout=120, strategy="fsdp")[0]
    _same_next_step(got, saved["zero2"])


def test_zero3_resumes_under_ddp_on_2_processes(saved: dict[str, Any]) -> None:
    got = run_distributed(_resume, str(saved["root"] / "zero3"), False, world_size=2,
                          timeout=120)[0]
    _same_next_step(got, saved["zero3"])


@pytest.mark.slow
@pytest.mark.ci_extra
def test_zero3_resumes_under_deepspeed_zero2_through_accel(saved: dict[str, Any]) -> None:
    got = run_distributed(_resume, str(saved["root"] / "zero3"), False, world_size=2,
                          timeout=120, strategy="deepspeed", zero_stage=2)[0]
    _same_next_step(got, saved["zero3"])


def test_another_kind_of_optimizer_is_refused_nothing_changed(saved: dict[str, Any]) -> None:
    model = toy(seed=99)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with accel.distributed(), pytest.raises(CheckpointError, match="another kind"):
        accel.load_state(Path(saved["root"]) / "zero3", model=model, optimizer=sgd)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
