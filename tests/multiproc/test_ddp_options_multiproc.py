"""DDP options and communication hooks on 2 gloo ranks: they reach the DDP wrapper and act.

Options come from ``prepare_model``, from ``accel.distributed(**options)`` and from the config
file (``ACCEL_CONFIG_FILE``); each is checked on the DDP object, and each hook by what it does
to the gradients (fp16/bf16: the all-reduced gradient is the rounded mean; PowerSGD: it counts
iterations and compresses, and the ranks stay equal; a callable: it is called).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import accel
from accel.testing import run_distributed

pytest.importorskip("numpy")  # torch's PowerSGDState needs it


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)  # never in the forward: needs find_unused_parameters
        self.register_buffer("mark", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) + self.mark
        return out


def _square(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))


def _local_batch(step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + accel.state().rank)
    return torch.randn(8, 32, generator=generator)


def _local_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """This rank's own gradients (no communication), from a plain copy of the module."""
    plain = copy.deepcopy(accel.unwrap_model(model))
    plain(x).square().sum().backward()
    return [p.grad for p in plain.parameters() if p.grad is not None]


def _all_grads(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """grads[rank][i] for every rank (a plain all_gather, not accel's)."""
    world = accel.state().world_size
    out: list[list[torch.Tensor]] = []
    for grad in grads:
        parts = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(parts, grad)
        out.append(parts)
    return [[out[i][r] for i in range(len(grads))] for r in range(world)]


def _ddp_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _compressed_mean_body(hook: str) -> dict[str, Any]:
    dtype = torch.float16 if hook == "fp16" else torch.bfloat16
    model = accel.prepare_model(_square(), comm_hook=hook)
    assert isinstance(model, DistributedDataParallel)
    x = _local_batch()
    per_rank = _all_grads(_local_grads(model, x))
    got = _ddp_grads(model, x)
    world = accel.state().world_size
    rounded_equal, differs_from_exact = [], []
    for i, grad in enumerate(got):
        # the hook: cast to the half type, divide by the world size, sum, cast back
        expected = torch.zeros_like(grad, dtype=dtype)
        for rank_grads in per_rank:
            expected += rank_grads[i].to(dtype) / world
        exact = sum(rank_grads[i] for rank_grads in per_rank) / world
        rounded_equal.append(torch.equal(grad, expected.float()))
        differs_from_exact.append(not torch.equal(grad, exact))
    return {"rounded_equal": rounded_equal, "differs": any(differs_from_exact),
            "hook": model._comm_hooks[0][0].__name__}


def _options_body(tmp: str) -> dict[str, Any]:
    rank = accel.state().rank
    out: dict[str, Any] = {"run_options": {k: v for k, v in accel.state().options.items()
                                           if k != "comm_hook"}}
    # options from prepare_model, over distributed()'s bucket_cap_mb=5
    net = _WithBuffer()
    net.mark.fill_(float(rank + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = accel.prepare_model(
            net, static_graph=False, gradient_as_bucket_view=True, bucket_cap_mb=7,
            broadcast_buffers=False,
        )
    out["warnings"] = [str(w.message) for w in caught if "broadcast_buffers" in str(w.message)]
    assert isinstance(model, DistributedDataParallel)
    model(torch.ones(2, 4)).sum().backward()
    out["prepare"] = {
        "find_unused_parameters": model.find_unused_parameters,  # from distributed()
        "static_graph": model.static_graph,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "bucket_bytes_cap": model.bucket_bytes_cap,
        "buffer": net.mark.item(),  # not broadcast: stays this rank's value
        "unused_grad": net.unused.weight.grad,
        "grad_is_bucket_view": net.linear.weight.grad._base is not None,
    }
    # options from distributed() alone (bucket_cap_mb=5, find_unused_parameters=True),
    # comm_hook overridden by prepare_model
    net2 = _WithBuffer()
    net2.mark.fill_(float(rank + 1))
    model2 = accel.prepare_model(net2, static_graph=True, comm_hook="no")
    model2(torch.ones(2, 4)).sum().backward()
    out["distributed"] = {
        "find_unused_parameters": model2.find_unused_parameters,
        "static_graph": model2.static_graph,
        "bucket_bytes_cap": model2.bucket_bytes_cap,
        "buffer": net2.mark.item(),  # broadcast from rank 0 (DDP's default)
        "hooks": len(model2._comm_hooks),
        "grad_is_bucket_view": net2.linear.weight.grad._base is not None,
    }
    # a nested block changes one option for its models
    with accel.distributed(bucket_cap_mb=2):
        model3 = accel.prepare_model(_WithBuffer())
        out["nested_bucket_bytes_cap"] = model3.bucket_bytes_cap
        out["nested_find_unused"] = model3.find_unused_parameters
    return out


def test_options_reach_the_ddp_wrapper() -> None:
    results = run_distributed(
        _options_body, "", world_size=2, find_unused_parameters=True, bucket_cap_mb=5,
        comm_hook="fp16",
    )
    mib = 1024 * 1024
    for rank, result in enumerate(results):
        assert result["run_options"] == {"find_unused_parameters": True, "bucket_cap_mb": 5}
        assert result["warnings"] == []  # accel's option, not torch's deprecation
        prepared = result["prepare"]
        assert prepared["find_unused_parameters"] is True
        assert prepared["static_graph"] is False
        assert prepared["gradient_as_bucket_view"] is True
        assert prepared["bucket_bytes_cap"] == 7 * mib
        assert prepared["buffer"] == rank + 1
        assert prepared["unused_grad"] is None  # found unused: no error, no gradient
        assert prepared["grad_is_bucket_view"]
        from_run = result["distributed"]
        assert from_run["find_unused_parameters"] is True
        assert from_run["static_graph"] is True
        assert from_run["bucket_bytes_cap"] == 5 * mib
        assert from_run["buffer"] == 1.0
        assert from_run["hooks"] == 0  # comm_hook="no" from prepare_model won
        assert not from_run["grad_is_bucket_view"]
        assert result["nested_bucket_bytes_cap"] == 2 * mib
        assert result["nested_find_unused"] is True


def _hooks_body() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hook in ("fp16", "bf16"):
        out[hook] = _compressed_mean_body(hook)
    # PowerSGD (from distributed()), with and without a wrapper; batched PowerSGD
    for name, options in (
        ("power_sgd", {}),
        ("power_sgd+fp16", {"comm_wrapper": "fp16"}),
        ("power_sgd+bf16", {"comm_wrapper": "bf16"}),
        # torch 2.13's batched hook fails once it starts compressing (it hands a 2-D matrix
        # to its batched orthogonalization), so it is checked in its all-reduce phase
        ("batched_power_sgd", {"comm_hook": "batched_power_sgd", "comm_state_option": {
            "matrix_approximation_rank": 2, "start_powerSGD_iter": 1000}}),
    ):
        out[name] = _train_power_sgd(options)
    out["callable"] = _callable_hook()
    return out


def _train_power_sgd(options: dict[str, Any]) -> dict[str, Any]:
    model = accel.prepare_model(_square(), **options)
    assert isinstance(model, DistributedDataParallel)
    hook, state = model._comm_hooks[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compressed = False
    for step in range(5):
        x = _local_batch(step)
        per_rank = _all_grads(_local_grads(model, x))
        grads = _ddp_grads(model, x)
        exact = sum(g[0] for g in per_rank) / len(per_rank)
        if step >= state.start_powerSGD_iter:
            compressed = compressed or not torch.allclose(grads[0], exact, atol=1e-6)
        optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(accel.state().world_size)]
    dist.all_gather(everyone, weights)
    return {
        "hook": hook.__name__,
        "state": type(state).__name__,
        "rank": state.matrix_approximation_rank,
        "start": state.start_powerSGD_iter,
        "iter": state.iter,
        "compressed": compressed,
        "ranks_agree": all(torch.equal(everyone[0], w) for w in everyone),
        "finite": bool(torch.isfinite(weights).all()),
    }


class _CallCounter:
    def __init__(self) -> None:
        self.calls = 0


def _mean_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations
    state.calls += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def _callable_hook() -> dict[str, Any]:
    counter = _CallCounter()
    model = accel.prepare_model(_square(), comm_hook=_mean_hook, comm_state=counter)
    x = _local_batch()
    per_rank = _all_grads(_local_grads(model, x))
    grads = _ddp_grads(model, x)
    exact = [sum(g[i] for g in per_rank) / len(per_rank) for i in range(len(grads))]
    return {
        "calls": counter.calls,
        "mean": all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, exact, strict=True)),
        "state_is_ours": model._comm_hooks[0][1] is counter,
    }


def test_comm_hooks_are_active() -> None:
    results = run_distributed(
        _hooks_body, world_size=2, comm_hook="power_sgd",
        comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
    )
    for result in results:
        for hook in ("fp16", "bf16"):
            assert all(result[hook]["rounded_equal"]), (hook, result[hook])
            assert result[hook]["differs"], f"{hook}: gradients equal the exact fp32 mean"
        assert result["fp16"]["hook"] == "fp16_compress_hook"
        for name in ("power_sgd", "power_sgd+fp16", "power_sgd+bf16", "batched_power_sgd"):
            got = result[name]
            assert got["state"] == "PowerSGDState", name
            start = 1000 if name == "batched_power_sgd" else 2
            assert (got["rank"], got["start"]) == (2, start), name
            assert got["iter"] >= 4, name  # the hook counted the steps
            assert got["ranks_agree"] and got["finite"], name
        assert result["power_sgd"]["hook"] == "powerSGD_hook"
        assert result["power_sgd"]["compressed"]  # low-rank: not the exact mean any more
        assert result["power_sgd+fp16"]["hook"] == "fp16_compress_wrapper_hook"
        assert result["batched_power_sgd"]["hook"] == "batched_powerSGD_hook"
        assert result["callable"] == {"calls": result["callable"]["calls"], "mean": True,
                                      "state_is_ours": True}
        assert result["callable"]["calls"] >= 1


def _config_body() -> dict[str, Any]:
    options = dict(accel.state().options)
    from_file = accel.prepare_model(_WithBuffer())
    overridden = accel.prepare_model(_WithBuffer(), bucket_cap_mb=4, comm_hook="no")
    assert isinstance(from_file, DistributedDataParallel)
    assert isinstance(overridden, DistributedDataParallel)
    return {
        "options": options,
        "find_unused_parameters": from_file.find_unused_parameters,
        "bucket_bytes_cap": from_file.bucket_bytes_cap,
        "hook": from_file._comm_hooks[0][0].__name__,
        "state": type(from_file._comm_hooks[0][1]).__name__,
        "override_bucket_bytes_cap": overridden.bucket_bytes_cap,
        "override_hooks": len(overridden._comm_hooks),
    }


def test_config_file_options_reach_prepare_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "accel.toml"
    config.write_text(
        "find_unused_parameters = true\nbucket_cap_mb = 3\ncomm_hook = \"power_sgd\"\n"
        "comm_wrapper = \"fp16\"\ncomm_state_option = {matrix_approximation_rank = 2}\n"
        "static_graph = false\n"
    )
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    # distributed()'s own value wins over the file's
    results = run_distributed(_config_body, world_size=2, static_graph=True)
    for result in results:
        assert result["options"] == {
            "find_unused_parameters": True, "bucket_cap_mb": 3.0, "comm_hook": "power_sgd",
            "comm_wrapper": "fp16", "comm_state_option": {"matrix_approximation_rank": 2},
            "static_graph": True,
        }
        assert result["find_unused_parameters"] is True
        assert result["bucket_bytes_cap"] == 3 * 1024 * 1024
        assert result["hook"] == "fp16_compress_wrapper_hook"
        assert result["state"] == "PowerSGDState"
        assert result["override_bucket_bytes_cap"] == 4 * 1024 * 1024
        assert result["override_hooks"] == 0
