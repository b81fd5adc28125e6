"""reshard_after_forward under FSDP2 on 2 gloo ranks: which modules keep their gathered
parameters between the forward and the backward.

Not given: torch's default, every block reshards but the root does not (its parameters are the
first the backward needs: resharding them would gather them twice per step). Given True or
False: applied to every module, root included. After the forward, a module that resharded
holds its sharded DTensor parameters again; one that did not holds the full tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sharded_after_forward(options: dict[str, Any]) -> dict[str, bool]:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = accel.prepare_model(Net(), strategy="fsdp", **options)
    out = model(torch.randn(3, 4))
    sharded = {
        "root": isinstance(model.head.weight, DTensor),
        "blocks": all(isinstance(b.lin.weight, DTensor) for b in model.blocks),
    }
    out.sum().backward()  # the backward still works and leaves every module resharded
    sharded["all_after_backward"] = all(isinstance(p, DTensor) for p in model.parameters())
    sharded["grads"] = all(p.grad is not None for p in model.parameters())
    return sharded


@pytest.mark.parametrize(
    ("options", "root", "blocks"),
    [({}, False, True),
     ({"reshard_after_forward": True}, True, True),
     ({"reshard_after_forward": False}, False, False)],
)
def test_root_keeps_its_parameters_gathered_by_default(
    options: dict[str, Any], root: bool, blocks: bool
) -> None:
    for result in run_distributed(_sharded_after_forward, options, world_size=2):
        assert result == {"root": root, "blocks": blocks, "all_after_backward": True,
                          "grads": True}
