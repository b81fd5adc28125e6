"""mixed_precision="fp8" over real processes (gloo, CPU): FSDP2 (with torchao's float8
all-gather) and tensor parallelism (torchao's float8 colwise/rowwise styles) train as one
process does, within fp8 tolerance; an FSDP fp8 checkpoint loads into a plain fp32 model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_distributed

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.preload("torchao.float8", "torchao.float8.float8_tensor_parallel")

STEPS = 4
ROWS = 8  # the global batch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch, learnt by heart (the loss must fall)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 16, generator=g))] * STEPS


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accel.get_state_dict(model).items()}


def _train(tp_plan: Any = None, save: str | None = None) -> dict[str, Any]:
    """Train ``STEPS`` SGD steps on this rank's rows (all rows for TP or one process); SGD:
    AdamW's normalised step turns fp8's small gradient differences into whole steps."""
    st = accel.state()
    torch.manual_seed(0)
    model = accel.prepare_model(Net(), tp_plan=tp_plan)
    optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    shards = 1 if tp_plan is not None else st.world_size
    rank = 0 if tp_plan is not None else st.rank
    losses = []
    for x, y in _data():
        rows = slice(rank * ROWS // shards, (rank + 1) * ROWS // shards)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        accel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accel.reduce(loss.detach(), "mean").item())
    if save is not None:
        accel.save_state(save, model=model, optimizer=optimizer)
    kinds = {name: type(m).__name__ for name, m in Net().named_modules()}
    kinds = {name: type(model.get_submodule(name)).__name__.removeprefix("FSDP")
             for name in kinds if name}
    return {"losses": losses, "weights": _full(model), "kinds": kinds,
            "styles": _tp_styles(model) if tp_plan is not None else {}}


def _tp_styles(model: nn.Module) -> dict[str, str]:
    """The style class whose input hook each module runs (torch's ``distribute_module``
    registers a lambda around the style's ``_prepare_input_fn`` partial)."""
    found = {}
    for name, module in model.named_modules():
        for hook in module._forward_pre_hooks.values():
            for cell in getattr(hook, "__closure__", None) or ():
                owner = getattr(cell.cell_contents, "func", None)
                qualname = getattr(owner, "__qualname__", "")
                if qualname.endswith("._prepare_input_fn"):
                    found[name] = qualname.split(".")[0]
    return found


def _fsdp_body(directory: str) -> dict[str, Any]:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    with accel.distributed(mixed_precision="fp8", strategy="fsdp"):
        result = _train(save=directory)
    with accel.distributed(mixed_precision="fp8", strategy="fsdp"):  # resumed, sharded
        model = accel.prepare_model(Net())
        weight = model.blocks[0].up.weight
        result["float8_all_gather"] = isinstance(
            weight.to_local(), WeightWithDynamicFloat8CastTensor
        )
        accel.load_state(directory, model=model)
        result["resumed"] = _full(model)
    return result


def _tp_body() -> dict[str, Any]:
    return _train(tp_plan=TP_PLAN)  # in run_distributed's block (mixed_precision, tp_size)


def _one_process() -> dict[str, Any]:
    with accel.distributed(mixed_precision="fp8"):
        return _train()


def _close(result: dict[str, Any], single: dict[str, Any]) -> None:
    assert result["losses"] == pytest.approx(single["losses"], rel=0.02)
    for name, tensor in single["weights"].items():
        assert torch.allclose(result["weights"][name], tensor, atol=2e-2), name
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.filterwarnings("ignore:The checkpoint was saved by 2 processes:UserWarning")
def test_fsdp2_fp8_equals_one_process_and_loads_into_plain_fp32(tmp_path: Path) -> None:
    single = _one_process()
    ranks = run_distributed(_fsdp_body, str(tmp_path / "ckpt"), world_size=2, timeout=120)
    for result in ranks:
        assert result["kinds"]["blocks.0.up"] == "Float8Linear"
        assert result["float8_all_gather"]  # tensorwise under FSDP2: float8 all-gather
        _close(result, single)
        for name, tensor in result["weights"].items():
            assert torch.equal(result["resumed"][name], tensor), name
    plain = Net()  # one process, fp32, no conversion: loads the sharded checkpoint
    with accel.distributed():
        accel.load_state(tmp_path / "ckpt", model=plain)
    for name, tensor in plain.state_dict().items():
        assert type(tensor) is torch.Tensor
        assert torch.equal(tensor, ranks[0]["weights"][name]), name


def test_tensor_parallel_fp8_uses_torchaos_float8_styles_and_equals_one_process() -> None:
    single = _one_process()
    ranks = run_distributed(_tp_body, world_size=2, timeout=120, mixed_precision="fp8",
                            tp_size=2)
    for result in ranks:
        assert result["kinds"]["blocks.1.down"] == "Float8Linear"
        assert result["styles"]["blocks.0.up"] == "Float8ColwiseParallel"
        assert result["styles"]["blocks.0.down"] == "Float8RowwiseParallel"
        _close(result, single)
