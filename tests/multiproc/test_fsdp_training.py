"""FSDP2 training through accel on real processes (gloo, CPU): equal to DDP, really sharded.

Every rank builds the same global batches and takes its slice, so FSDP (each rank holds a shard
of every parameter) and DDP (each rank holds all of them) train on the same data and must end
with the same weights. Sharded parameters are compared through ``DTensor.full_tensor()``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.errors import ConfigError, StaleParametersError
from accel.testing import run_distributed

PER_RANK = 2
FEATURES = 5
WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(count: int, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(count, world_size * PER_RANK, FEATURES, generator=generator)
    y = torch.randn(count, world_size * PER_RANK, 2, generator=generator)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return [(x[i, rows], y[i, rows]) for i in range(count)]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by name (gathered from the shards under FSDP; every rank)."""
    out = {}
    for name, param in model.named_parameters():
        full = getattr(param, "full_tensor", None)
        out[name.removeprefix("module.")] = (full() if full else param).detach().clone()
    return out


def _train(model: nn.Module, optimizer: Any, batches: list[Any]) -> dict[str, Any]:
    """Accumulate 2 batches per step, clip, AdamW; record norms, outputs and sync-off grads."""
    norms: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    grads_none_while_accumulating: list[bool] = []
    for x, y in batches:
        with accel.accumulate(model) as sync:
            out = model(x)
            outputs.append(accel.gather_for_metrics(out.detach()))
            accel.backward(nn.functional.mse_loss(out, y))
            if sync:
                norms.append(accel.clip_grad_norm_(model.parameters(), 0.05))
            else:
                grads_none_while_accumulating.append(
                    all(p.grad is None for p in model.parameters())
                )
            optimizer.step()
            optimizer.zero_grad()
    return {"norms": norms, "outputs": outputs, "accumulating": grads_none_while_accumulating}


def _parity_body() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    st = accel.state()
    batches = _batches(6, st.rank, st.world_size)
    result: dict[str, Any] = {"world_size": st.world_size}
    with accel.distributed(gradient_accumulation_steps=2):
        ddp = accel.prepare_model(_net(), strategy="ddp")
        ddp_opt = accel.prepare_optimizer(torch.optim.AdamW(ddp.parameters(), lr=0.05))
        ddp_run = _train(ddp, ddp_opt, batches)

        net = _net()
        total = {name: tuple(p.shape) for name, p in net.named_parameters()}
        fsdp = accel.prepare_model(net, strategy="fsdp")
        fsdp_opt = accel.prepare_optimizer(torch.optim.AdamW(fsdp.parameters(), lr=0.05))
        fsdp_run = _train(fsdp, fsdp_opt, batches)

        result["same_object"] = fsdp is net and accel.unwrap_model(fsdp) is net
        result["sharded"] = [isinstance(m, FSDPModule) for m in (net, *net.blocks)]
        result["others_unsharded"] = not isinstance(net.inp, FSDPModule)
        result["dtensors"] = all(isinstance(p, DTensor) for p in net.parameters())
        result["norm_types"] = {type(n) for n in fsdp_run["norms"]}
        result["norms"] = (torch.stack(fsdp_run["norms"]), torch.stack(ddp_run["norms"]))
        result["outputs_equal"] = all(
            torch.allclose(a, b, atol=1e-5)
            for a, b in zip(fsdp_run["outputs"], ddp_run["outputs"], strict=True)
        )
        result["gathered_rows"] = fsdp_run["outputs"][0].shape[0]
        result["fsdp_grads_none_while_accumulating"] = fsdp_run["accumulating"]
        full_fsdp, full_ddp = _full(fsdp), _full(ddp)
        result["max_diff"] = max(
            (full_fsdp[name] - full_ddp[name]).abs().max().item() for name in full_ddp
        )
        result["moved"] = max(
            (full_fsdp[name] - param).abs().max().item()
            for name, param in _net().named_parameters()
        )
        # Memory: this rank's shards of parameters and AdamW moments.
        local = {name: p.to_local().numel() for name, p in net.named_parameters()}
        moments = {
            name: tuple(fsdp_opt.state[p][key].to_local().numel() for key in ("exp_avg",
                                                                               "exp_avg_sq"))
            for name, p in net.named_parameters()
        }
        result["total"], result["local"], result["moments"] = total, local, moments
        result["norms_across_ranks"] = accel.gather(torch.stack(fsdp_run["norms"])[None])
    return result


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def parity(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_distributed(_parity_body, world_size=request.param, timeout=180)


def test_fsdp_training_equals_ddp(parity: list[dict[str, Any]]) -> None:
    for result in parity:
        assert result["moved"] > 1e-3  # the loop really trained
        assert result["max_diff"] < 1e-5
        fsdp_norms, ddp_norms = result["norms"]
        assert len(fsdp_norms) == 3
        assert torch.allclose(fsdp_norms, ddp_norms, atol=1e-5)
        assert (fsdp_norms > 0.05).all()  # max_norm=0.05: every step really clipped
        assert result["outputs_equal"]
        assert result["gathered_rows"] == PER_RANK * result["world_size"]


def test_clip_norm_is_a_plain_tensor_equal_on_every_rank(parity: list[dict[str, Any]]) -> None:
    for result in parity:
        assert result["norm_types"] == {torch.Tensor}
        rows = result["norms_across_ranks"]
        assert all(torch.equal(rows[0], row) for row in rows)


def test_accumulation_turns_fsdp_gradient_sync_off(parity: list[dict[str, Any]]) -> None:
    # With set_requires_gradient_sync(False) FSDP2 keeps the gradient unsharded inside and
    # writes no sharded .grad until the sync step's reduce-scatter.
    for result in parity:
        assert result["fsdp_grads_none_while_accumulating"] == [True, True, True]


def test_default_shard_modules_are_the_blocks(parity: list[dict[str, Any]]) -> None:
    for result in parity:
        assert result["same_object"]
        assert result["sharded"] == [True, True, True, True]  # root + the 3 blocks
        assert result["others_unsharded"]
        assert result["dtensors"]


def test_each_rank_holds_about_one_nth(parity: list[dict[str, Any]]) -> None:
    world = parity[0]["world_size"]
    shapes = parity[0]["total"]
    for name, shape in shapes.items():
        numel, rows = math.prod(shape), shape[0]
        shards = [result["local"][name] for result in parity]
        assert sum(shards) == numel, name  # the shards partition the parameter (dim 0)
        assert max(shards) == math.ceil(rows / world) * (numel // rows), name
    everything = sum(math.prod(shape) for shape in shapes.values())
    for result in parity:
        held = sum(result["local"].values())
        # ~1/N: at most one extra row of each parameter from rounding dim 0 up.
        assert held <= everything / world + sum(
            math.prod(shape[1:]) for shape in shapes.values()
        )
        assert held < everything * 0.75
        for name, (avg, avg_sq) in result["moments"].items():
            assert avg == avg_sq == result["local"][name]  # AdamW state is sharded alike


# -- mixed precision, reshard_after_forward, cpu_offload ----------------------------------
def _two_steps(model: nn.Module, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    for x, y in _batches(2, rank, world_size):
        accel.backward(nn.functional.mse_loss(model(x), y))
        accel.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return _full(model)


def _options_body() -> dict[str, Any]:
    st = accel.state()
    result: dict[str, Any] = {}
    plain = _two_steps(accel.prepare_model(_net(), strategy="fsdp"), st.rank, st.world_size)
    for label, options in {
        "no_reshard": {"reshard_after_forward": False},
        "offload": {"cpu_offload": True},
        "by_name": {"shard_modules": ["Block", nn.Linear]},
    }.items():
        model = accel.prepare_model(_net(), strategy="fsdp", **options)
        full = _two_steps(model, st.rank, st.world_size)
        result[label] = max((full[k] - plain[k]).abs().max().item() for k in plain)
    # no_sync: local accumulation, then one synchronising backward = two synced backwards
    (x1, _), (x2, _) = _batches(2, st.rank, st.world_size)
    local, synced = (accel.prepare_model(_net(), strategy="fsdp") for _ in range(2))
    with accel.no_sync(local):
        local(x1).sum().backward()
    result["no_sync_grads_none"] = all(p.grad is None for p in local.parameters())
    local(x2).sum().backward()
    synced(x1).sum().backward()
    synced(x2).sum().backward()
    result["no_sync_diff"] = max(
        (a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
        for a, b in zip(local.parameters(), synced.parameters(), strict=True)
    )
    with accel.distributed(mixed_precision="bf16"):
        net = _net()
        seen: list[torch.dtype] = []
        net.blocks[1].register_forward_hook(
            lambda module, args, out: seen.append(module.lin.weight.dtype)
        )
        model = accel.prepare_model(net, strategy="fsdp")
        out = model(_batches(1, st.rank, st.world_size)[0][0])
        accel.backward(out.sum())
        result["bf16"] = {
            "inside_forward": seen,
            "output": out.dtype,
            "sharded": {p.dtype for p in model.parameters()},
            "grads": {p.grad.dtype for p in model.parameters()},
            "policy": str(model.blocks[1]._get_fsdp_state()._mp_policy),
        }
    return result


def test_options_no_sync_and_mixed_precision_policy() -> None:
    for result in run_distributed(_options_body, world_size=2, timeout=180):
        assert result["no_reshard"] < 1e-6
        assert result["offload"] < 1e-6
        assert result["by_name"] < 1e-5
        assert result["no_sync_grads_none"]
        assert result["no_sync_diff"] < 1e-5
        bf16 = result["bf16"]
        assert bf16["inside_forward"] == [torch.bfloat16]  # MixedPrecisionPolicy applied
        assert bf16["output"] == torch.float32  # the autocast wrapper's fp32 outputs
        assert bf16["sharded"] == {torch.float32}  # fp32 master weights
        assert bf16["grads"] == {torch.float32}
        assert "reduce_dtype=torch.bfloat16" in bf16["policy"]


# -- optimizer order, errors, fp16 scaling ------------------------------------------------
def _errors_body() -> dict[str, Any]:
    with accel.distributed(strategy="fsdp"):  # accel.prepare uses the state's strategy
        return _errors_checks()


def _errors_checks() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    st = accel.state()
    result: dict[str, Any] = {}
    net = _net()
    early = torch.optim.AdamW(net.parameters(), lr=0.05)
    model = accel.prepare_model(net, strategy="fsdp")
    for label, call in {
        "prepare_optimizer": lambda: accel.prepare_optimizer(early),
        "prepare_alone": lambda: accel.prepare(early),
    }.items():
        try:
            call()
        except StaleParametersError as error:
            result[label] = str(error)
    # The right order, and prepare(model, optimizer) together, train alike.
    right = _two_steps(model, st.rank, st.world_size)
    net2 = _net()
    together_model, together_opt = accel.prepare(
        net2, torch.optim.AdamW(net2.parameters(), lr=0.05)
    )
    result["together_sharded"] = isinstance(together_model, FSDPModule)
    result["remapped_to_shards"] = all(
        a is b for a, b in zip(together_opt.param_groups[0]["params"],
                               together_model.parameters(), strict=True)
    )
    for x, y in _batches(2, st.rank, st.world_size):
        accel.backward(nn.functional.mse_loss(together_model(x), y))
        accel.clip_grad_norm_(together_model.parameters(), 1.0)
        together_opt.step()
        together_opt.zero_grad()
    together = _full(together_model)
    result["together_diff"] = max((together[k] - right[k]).abs().max().item() for k in right)
    # An optimizer that already has state for the unsharded parameters is refused.
    net3 = _net()
    stepped = torch.optim.AdamW(net3.parameters(), lr=0.05)
    net3(torch.ones(1, FEATURES)).sum().backward()
    stepped.step()
    try:
        accel.prepare(net3, stepped)
    except StaleParametersError as error:
        result["with_state"] = str(error)
    try:
        accel.prepare_model(_net(), strategy="fsdp", shard_modules="Attention")
    except ConfigError as error:
        result["absent"] = str(error)
    return result


def test_optimizer_made_before_sharding() -> None:
    for result in run_distributed(_errors_body, world_size=2, timeout=180):
        for label in ("prepare_optimizer", "prepare_alone"):
            assert "'AdamW'" in result[label]
            assert "prepare_model" in result[label]
            assert "accel.prepare(model, optimizer)" in result[label]
            assert "'inp.weight'" in result[label]
        assert result["together_sharded"]
        assert result["remapped_to_shards"]
        assert result["together_diff"] < 1e-6
        assert "already has state" in result["with_state"]
        assert "'Attention'" in result["absent"] and "'Block'" in result["absent"]


def _fp16_body() -> dict[str, Any]:
    st = accel.state()
    result: dict[str, Any] = {}
    with accel.distributed(mixed_precision="fp16"):
        model = accel.prepare_model(_net(), strategy="fsdp")
        optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
        skipped: list[bool] = []
        injected_at = None
        for step, (x, y) in enumerate(_batches(24, st.rank, st.world_size)):
            before = _full(model)
            accel.backward(nn.functional.mse_loss(model(x), y))
            # Once the scale has settled (a step went through), an overflow in rank 1's
            # shard only: every rank must skip that step.
            if injected_at is None and skipped and not skipped[-1]:
                injected_at = step
                if st.rank == 1:
                    model.head.weight.grad.to_local().view(-1)[0] = float("inf")
            accel.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            skipped.append(accel.optimizer_step_was_skipped(optimizer))
            if step == injected_at:
                after = _full(model)
                result["unchanged_after_skip"] = all(
                    torch.equal(before[k], after[k]) for k in before
                )
        result["skipped"] = skipped
        result["injected_at"] = injected_at
        result["sharded_dtypes"] = {p.dtype for p in model.parameters()}
    return result


@pytest.mark.slow
@pytest.mark.ci_extra
def test_fp16_overflow_on_one_shard_skips_the_step_on_every_rank() -> None:
    results = run_distributed(_fp16_body, world_size=2, timeout=180)
    assert results[0]["skipped"] == results[1]["skipped"]  # the ranks agree on every step
    for result in results:
        at = result["injected_at"]
        assert at is not None
        assert result["skipped"][at] is True
        assert result["unchanged_after_skip"]
        assert not all(result["skipped"][at + 1 :])  # training goes on afterwards
        assert result["sharded_dtypes"] == {torch.float32}
