"""A DeepSpeed config's "optimizer"/"scheduler" sections against the loop's own torch optimizer
and scheduler: the torch optimizer fills the section's "auto" values and is used; another kind
or a differing value is refused naming both; a scheduler section beside a torch scheduler is
refused; alone, its warmup learning rates are filled."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from accel.errors import ConfigError
from accel.parallel.deepspeed.sections import Client, reconcile

TEMPLATE = {  # the shape of the templates Accelerate and transformers ship
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                  "warmup_max_lr": "auto",
                                                  "warmup_num_steps": 10}},
    "zero_optimization": {"stage": 2},
}


def _client(kind: type = torch.optim.AdamW, scheduler: bool = False, **hyper: Any) -> Client:
    optimizer = kind(nn.Linear(2, 2).parameters(), **{"lr": 1e-3, **hyper})
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1) if scheduler else None
    return Client.of(optimizer, sched)


def test_the_loops_optimizer_replaces_an_auto_section_and_fills_the_scheduler() -> None:
    out = reconcile(TEMPLATE, _client())
    assert "optimizer" not in out
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                          "warmup_num_steps": 10}
    assert TEMPLATE["optimizer"]["params"]["lr"] == "auto"  # the user's dict is unchanged


@pytest.mark.parametrize(("section", "client", "words"), [
    ({"type": "AdamW", "params": {"lr": 3e-4}}, _client(), "lr: config 0.0003, optimizer 0.001"),
    ({"type": "AdamW", "params": {"betas": [0.9, 0.95]}}, _client(), "betas: config"),
    ({"type": "Lamb", "params": {"lr": "auto"}}, _client(), "'Lamb' and the loop passes a "
     "torch adamw"),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, _client(), "'Adam'"),
    ({"type": "AdamW"}, _client(torch.optim.SGD), "torch sgd"),
])
def test_a_section_that_disagrees_with_the_optimizer_is_refused(
    section: dict[str, Any], client: Client, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        reconcile({"optimizer": section}, client)
    assert words in str(info.value), str(info.value)


def test_sections_that_agree_are_accepted() -> None:
    same = {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01,
                                       "torch_adam": True}}
    assert reconcile({"optimizer": same}, _client()) == {}  # DeepSpeed's Adam is AdamW
    plain = {"type": "Adam", "params": {"adam_w_mode": False}}
    assert reconcile({"optimizer": plain}, _client(torch.optim.Adam)) == {}


def test_a_scheduler_section_beside_a_torch_scheduler_is_refused() -> None:
    with pytest.raises(ConfigError, match="both would set the learning rate"):
        reconcile(TEMPLATE, _client(scheduler=True))
    alone = reconcile({"scheduler": TEMPLATE["scheduler"],
                       "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}, Client())
    assert alone["scheduler"]["params"]["warmup_max_lr"] == 5e-4  # from the config's optimizer
