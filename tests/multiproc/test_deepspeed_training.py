"""DeepSpeed (``strategy="deepspeed"``) on 2 gloo processes: the user's loop unchanged.

ZeRO 1, 2 and 3 with accumulation and clipping train exactly as one plain process (losses and
weights), bf16 runs through the engine's bf16 weights with fp32 outputs, full weights come back
under ZeRO-3 (``get_state_dict``, ``save_model``), a transformers GPT-2 trains under ZeRO-3 as
in one process, and the loop's mistakes are errors. No C++ extension is built: DeepSpeed's
shared-memory op is skipped on the CPU and the optimizers are torch's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.errors import ConfigError
from accel.testing import run_distributed
from tests.deepspeed_marks import DEEPSPEED

pytestmark = DEEPSPEED

ROWS, PER_RANK, LR, CLIP = 64, 4, 0.01, 0.5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 2))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 2, generator=g))


def _loop(model: Any, optimizer: Any, loader: Any, clip: float | None) -> list[float]:
    losses = []
    for x, y in loader:
        with accel.accumulate(model) as sync:
            loss = nn.functional.mse_loss(model(x), y)
            accel.backward(loss)
            if sync and clip is not None:
                accel.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accel.reduce(loss.detach().float(), "mean")))
    return losses


def _plain(accumulation: int, clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One plain process in torch alone: global batches of 2 x PER_RANK rows."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    loader = DataLoader(_data(), batch_size=2 * PER_RANK)
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        (loss / accumulation).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulation == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero_run(clip: float | None, save_to: str | None) -> dict[str, Any]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(_data(), batch_size=PER_RANK)
    model, opt, loader = accel.prepare(model, opt, loader)
    losses = _loop(model, opt, loader, clip)
    engine = model
    weights = accel.get_state_dict(model)
    saved = None
    if save_to is not None:
        accel.save_model(model, save_to)
        if accel.state().is_main_process:
            saved = accel.load(os.path.join(save_to, "model.safetensors"))
    return {
        "losses": losses, "weights": weights, "saved": saved,
        "stage": engine.zero_optimization_stage(),
        "gas": engine.gradient_accumulation_steps(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "clip": engine.gradient_clipping(),
        "unwrapped": type(accel.unwrap_model(model)).__name__,
        "offload": (engine.zero_cpu_offload(), str(getattr(engine.zero_offload_param(),
                                                               "device", "none"))),
        "optimizer": type(engine.optimizer.optimizer).__name__,
        "extensions": os.path.isdir(os.path.expanduser("~/.cache/torch_extensions")),
    }


@pytest.mark.parametrize(  # stages 1 and 3 take >=5.7 s
    "stage",
    [pytest.param(1, marks=pytest.mark.ci_extra), 2, pytest.param(3, marks=pytest.mark.ci_extra)],
)
def test_zero_stages_with_accumulation_and_clipping_equal_one_process(
    stage: int, tmp_path: Path
) -> None:
    had_extensions = os.path.isdir(os.path.expanduser("~/.cache/torch_extensions"))
    save_to = str(tmp_path / "weights") if stage == 3 else None
    results = run_distributed(
        _zero_run, CLIP, save_to, world_size=2, strategy="deepspeed", zero_stage=stage,
        gradient_accumulation_steps=2, timeout=120,
    )
    losses, weights = _plain(2, CLIP)
    for out in results:
        assert (out["stage"], out["gas"], out["micro"]) == (stage, 2, PER_RANK)
        assert out["clip"] == CLIP  # "auto" (missing) took the loop's clip_grad_norm_ value
        assert out["unwrapped"] == "Sequential"
        assert max(abs(a - b) for a, b in zip(out["losses"], losses, strict=True)) < 1e-5
        assert out["weights"].keys() == weights.keys()
        for key, value in weights.items():
            torch.testing.assert_close(out["weights"][key], value, atol=1e-5, rtol=0)
    if save_to is not None:  # ZeRO-3: save_model wrote the full weights
        saved = results[0]["saved"]
        for key, value in weights.items():
            torch.testing.assert_close(saved[key], value, atol=1e-5, rtol=0)
    assert results[0]["extensions"] == had_extensions  # nothing was compiled


@pytest.mark.parametrize(
    ("stage", "params"), [(2, None), pytest.param(3, "cpu", marks=pytest.mark.ci_extra)]
)
def test_cpu_offload_trains_with_the_torch_optimizer_as_one_process(
    stage: int, params: str | None
) -> None:
    # DeepSpeed would swap in its DeepSpeedCPUAdam (a C++ build, minutes); accel keeps the
    # torch optimizer on the offloaded states (zero_force_ds_cpu_optimizer: false)
    had_extensions = os.path.isdir(os.path.expanduser("~/.cache/torch_extensions"))
    results = run_distributed(
        _zero_run, CLIP, None, world_size=2, strategy="deepspeed", zero_stage=stage,
        offload_optimizer="cpu", offload_params=params, gradient_accumulation_steps=2,
        timeout=120,
    )
    losses, weights = _plain(2, CLIP)
    for out in results:
        assert out["stage"] == stage
        assert out["offload"] == (True, params or "none")
        assert out["optimizer"] == "AdamW"
        assert max(abs(a - b) for a, b in zip(out["losses"], losses, strict=True)) < 1e-5
        for key, value in weights.items():
            torch.testing.assert_close(out["weights"][key], value, atol=1e-5, rtol=0)
    assert results[0]["extensions"] == had_extensions  # nothing was compiled


def _bf16_run() -> dict[str, Any]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(_data(), batch_size=PER_RANK)
    model, opt, loader = accel.prepare(model, opt, loader)
    x = torch.randn(3, 5)
    out_dtype = model(x).dtype
    losses = _loop(model, opt, loader, None)
    return {
        "losses": losses, "out": out_dtype,
        "param": next(accel.unwrap_model(model).parameters()).dtype,
        "bf16": model.bfloat16_enabled(),
    }


def test_bf16_from_mixed_precision_trains_close_to_fp32() -> None:
    config = {"bf16": {"enabled": "auto"}, "train_batch_size": "auto",
              "zero_optimization": {"stage": 2}}
    results = run_distributed(
        _bf16_run, world_size=2, strategy="deepspeed", mixed_precision="bf16",
        deepspeed_config=config, timeout=120,
    )
    losses, _ = _plain(1, None)
    for out in results:
        assert out["bf16"] and out["param"] == torch.bfloat16 and out["out"] == torch.float32
        assert max(abs(a - b) for a, b in zip(out["losses"], losses, strict=True)) < 3e-2


def _errors_run(config_path: str) -> list[str]:
    caught = []
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(ConfigError, match=r"accel\.prepare_model") as info:
        accel.prepare_model(model)
    caught.append(str(info.value))
    loader = DataLoader(_data(), batch_size=PER_RANK)
    model, opt, loader = accel.prepare(model, opt, loader)
    x, y = next(iter(loader))
    accel.backward(nn.functional.mse_loss(model(x), y))
    with pytest.raises(ConfigError, match=r"max_norm=2\.0.*gradient_clipping=1\.0"):
        accel.clip_grad_norm_(model.parameters(), 2.0)
    norm = accel.clip_grad_norm_(model.parameters(), 1.0)  # the config's value: fine
    opt.step()
    assert torch.isnan(norm) or norm >= 0
    with pytest.raises(ConfigError, match="clip_grad_value_"):
        accel.clip_grad_value_(model.parameters(), 1.0)
    with pytest.raises(ConfigError, match="one engine per block"):
        accel.prepare(_net(), torch.optim.SGD(_net().parameters(), lr=0.1))
    caught.append(config_path)
    return caught


@pytest.mark.ci_extra
def test_loop_mistakes_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 1.0, "zero_optimization": {"stage": "auto"}, '
                    '"train_micro_batch_size_per_gpu": "auto"}')
    with pytest.raises(ConfigError, match=r"keeps \"auto\" at \['zero_optimization.stage'\]"):
        run_distributed(_errors_run, str(path), world_size=2, strategy="deepspeed",
                        deepspeed_config=str(path), timeout=120)
    path.write_text('{"gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": "auto"}')
    run_distributed(_errors_run, str(path), world_size=2, strategy="deepspeed",
                    deepspeed_config=str(path), zero_stage=2, timeout=120)


def _gpt2_run(zero: bool) -> dict[str, Any]:
    from tests.hf import _models as M

    model = M.build("gpt2")
    opt = M.optimizer(model)
    model, opt = accel.prepare(model, opt)
    losses = M.train(model, opt, "gpt2", range(3), micro=2)
    return {"losses": losses, "weights": M.state(model),
            "stage": model.zero_optimization_stage() if zero else None}


@pytest.mark.slow  # transformers in the workers
@pytest.mark.preload("transformers", "transformers.models.gpt2.modeling_gpt2")
@pytest.mark.ci_extra
def test_transformers_gpt2_under_zero3_equals_one_process() -> None:
    pytest.importorskip("transformers")
    config = {
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    zero = run_distributed(_gpt2_run, True, world_size=2, strategy="deepspeed",
                           deepspeed_config=config, gradient_accumulation_steps=2, timeout=120)
    plain = run_distributed(_gpt2_run, False, world_size=1, gradient_accumulation_steps=2,
                            timeout=120)[0]
    for out in zero:
        assert out["stage"] == 3
        assert max(abs(a - b) for a, b in zip(out["losses"], plain["losses"], strict=True)) < 1e-5
        assert out["weights"].keys() == plain["weights"].keys()
        worst = max((out["weights"][k] - v).abs().max().item()
                    for k, v in plain["weights"].items())
        # ZeRO-3 reduce-scatters flat buckets in another order than one process sums: the
        # gradients differ by rounding (~1e-8). AdamW's first step moves an element by
        # lr * g / (|g| + eps), whose slope at |g| ~ eps is lr / (4 eps) = 500 here, so an
        # element whose gradient is eps-sized moves ~2.7e-5 apart (transformers 5.24, h.0
        # mlp.c_proj). 1e-4 is 5% of one step's lr: a missed reduction (a rank stepping on its
        # own half of the batch) moves weights by ~lr and still fails; the losses agree to 1e-5.
        assert worst < 1e-4, worst
