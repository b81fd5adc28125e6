"""Real transformers models train alike on 1 process, DDP and FSDP (2 gloo processes).

One launch of 2 processes trains every family several ways (DDP, FSDP, with accumulation,
with HF gradient checkpointing, in bf16) on the same global batches, each rank taking its
half; the test process trains the same model on one process. fp32 runs must agree to 1e-5
(losses, clipped gradient norms and every weight); bf16 runs only stay close. The trained
DDP and FSDP models then ``generate()`` (through ``unwrap_model``, as the no_trainer
examples do), which must give a plain copy's tokens. Skipped without transformers and peft.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import accel
from accel.testing import run_distributed
from tests.hf import _models as M

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = [
    pytest.mark.preload(*M.PRELOAD),  # the workers' transformers and peft, imported once
    pytest.mark.ci_extra,  # ~100 s of the suite's 2 cores on a slow machine
    pytest.mark.slow,  # one launch of 2 processes trains every family 8 ways
    pytest.mark.filterwarnings("ignore:.*will be removed in v6:FutureWarning"),  # peft's calls
]

STEPS = 3
FP32_TOL = 1e-5


def _checkpointing_on(model: torch.nn.Module, family: str) -> None:
    """HF gradient checkpointing (``activation_checkpointing_enable`` is its name from 5.x).

    With LoRA the embedding is frozen, so its output must be made to require grad for the
    checkpointed blocks to pass gradients back (transformers 5 does this itself; peft's docs
    ask for ``enable_input_require_grads()`` with 4.x).
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        enable = model.gradient_checkpointing_enable
    enable()
    if family == "llama_lora":
        model.enable_input_require_grads()


def _run(
    family: str, strategy: str, *, micro: int = 1, checkpointing: bool = False,
    precision: str = "no", generate: bool = False,
) -> dict[str, Any]:
    """Train STEPS steps: the global losses, how often the first block's first layer ran
    (forward and recomputation), and the final weights on rank 0."""
    with accel.distributed(gradient_accumulation_steps=micro, mixed_precision=precision):
        model = M.build(family)
        if checkpointing:
            _checkpointing_on(model, family)
        calls: list[int] = []
        M.first_layer(model, family).register_forward_hook(lambda *_: calls.append(1))
        model = accel.prepare_model(model, strategy=strategy)
        optimizer = accel.prepare_optimizer(M.optimizer(model))
        norms: list[float] = []
        losses = M.train(model, optimizer, family, range(STEPS), micro=micro, norms=norms)
        block_calls = len(calls)
        weights = M.state(model)
        generated = _generated(model, family, weights) if generate else None
    return {
        "losses": losses,
        "norms": norms,
        "block_calls": block_calls,
        "state": weights if accel.state().is_main_process else None,
        "generated": generated,
    }


def _generated(
    model: torch.nn.Module, family: str, weights: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | str | None:
    """``generate()`` of the trained prepared model (through ``unwrap_model``, as the
    no_trainer examples evaluate) and of a plain model holding its weights, or what the
    former raised (every rank alike)."""
    if family not in M.GENERATIVE:
        return None
    plain = M.build(family)
    plain.load_state_dict(weights)
    try:
        got = M.generate(accel.unwrap_model(model), family)
    except Exception:
        return traceback.format_exc()
    return got, M.generate(plain, family)


RUNS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp", "generate": True},
    "fsdp": {"strategy": "fsdp", "generate": True},
    "ddp_accum": {"strategy": "ddp", "micro": 2},
    "fsdp_accum": {"strategy": "fsdp", "micro": 2},
    "ddp_checkpointing": {"strategy": "ddp", "checkpointing": True},
    "fsdp_checkpointing": {"strategy": "fsdp", "checkpointing": True},
    "ddp_bf16": {"strategy": "ddp", "precision": "bf16"},
    "fsdp_bf16": {"strategy": "fsdp", "precision": "bf16"},
}


def _parity_body(families: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every run of every family; a run that raised is its traceback (the ranks agree)."""
    out: dict[str, dict[str, Any]] = {}
    for family in families:
        out[family] = {}
        for label, options in RUNS.items():
            try:
                out[family][label] = _run(family, **options)
            except Exception:
                out[family][label] = traceback.format_exc()
    return out


def _one_process(family: str) -> dict[str, Any]:
    with accel.distributed():
        model = accel.prepare_model(M.build(family))
        optimizer = accel.prepare_optimizer(M.optimizer(model))
        norms: list[float] = []
        losses = M.train(model, optimizer, family, range(STEPS), norms=norms)
        return {"losses": losses, "norms": norms, "state": M.state(model)}


@pytest.fixture(scope="module")
def parity() -> dict[str, dict[str, Any]]:
    return run_distributed(_parity_body, M.FAMILIES, world_size=2, timeout=600)[0]


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    return {family: _one_process(family) for family in M.FAMILIES}


def _result(parity: dict[str, dict[str, Any]], family: str, label: str) -> dict[str, Any]:
    value = parity[family][label]
    if isinstance(value, str):
        pytest.fail(f"the {label!r} run of {family!r} raised on 2 processes:\n{value}")
    return value  # type: ignore[no-any-return]


def _assert_same(a: dict[str, Any], b: dict[str, Any], tol: float = FP32_TOL) -> None:
    """Same losses, same gradient norms (clip_grad_norm_ over every rank), same weights."""
    for key in ("losses", "norms"):
        assert len(a[key]) == len(b[key]) == STEPS
        diff = max(abs(x - y) for x, y in zip(a[key], b[key], strict=True))
        assert diff <= tol, (key, a[key], b[key])
    assert M.max_diff(a["state"], b["state"]) <= tol


def _assert_trained(run: dict[str, Any], family: str) -> None:
    """The run really moved the trainable weights (the comparisons are not vacuous)."""
    initial = {k: v.float() for k, v in M.build(family).state_dict().items()}
    moved = max((run["state"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3


def _mean_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in b]).mean().item()


families = pytest.mark.parametrize("family", M.FAMILIES)


@families
def test_ddp_equals_one_process(
    parity: dict[str, Any], one_process: dict[str, Any], family: str
) -> None:
    ddp = _result(parity, family, "ddp")
    _assert_trained(ddp, family)
    _assert_same(ddp, one_process[family])


@families
def test_fsdp_equals_ddp(parity: dict[str, Any], family: str) -> None:
    _assert_same(_result(parity, family, "fsdp"), _result(parity, family, "ddp"))


@families
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulation_2_equals_the_whole_batch(
    parity: dict[str, Any], family: str, strategy: str
) -> None:
    # 2 micro-batches of half the rows each, under accel.accumulate, make the same steps as
    # the whole batch at once.
    _assert_same(_result(parity, family, f"{strategy}_accum"), _result(parity, family, strategy))


@families
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gradient_checkpointing_changes_nothing(
    parity: dict[str, Any], family: str, strategy: str
) -> None:
    plain = _result(parity, family, strategy)
    checkpointed = _result(parity, family, f"{strategy}_checkpointing")
    assert plain["block_calls"] == STEPS
    assert checkpointed["block_calls"] == 2 * STEPS  # the block really ran again in backward
    _assert_same(checkpointed, plain)


@pytest.mark.parametrize("family", M.GENERATIVE)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_generate_on_the_prepared_model(parity: dict[str, Any], family: str, strategy: str) -> None:
    generated = _result(parity, family, strategy)["generated"]
    if isinstance(generated, str):
        pytest.fail(f"generate() of {family!r} prepared with {strategy!r} raised:\n{generated}")
    got, expected = generated
    assert got.shape[1] >= M.NEW_TOKENS
    assert torch.equal(got, expected)


@families
def test_bf16_fsdp_stays_close_to_bf16_ddp(parity: dict[str, Any], family: str) -> None:
    fsdp, ddp = _result(parity, family, "fsdp_bf16"), _result(parity, family, "ddp_bf16")
    fp32 = _result(parity, family, "ddp")
    for run in (fsdp, ddp):
        assert run["losses"] != fp32["losses"]  # bf16 really computed
        assert max(abs(a - b) for a, b in zip(run["losses"], fp32["losses"], strict=True)) < 1e-2
    assert max(abs(a - b) for a, b in zip(fsdp["losses"], ddp["losses"], strict=True)) < 1e-2
    # bf16 rounding may flip the sign of a tiny gradient's AdamW update, so single weights may
    # differ by a few learning rates; on average the runs stay far closer than training moved
    initial = M.build(family).state_dict()
    assert _mean_abs(fsdp["state"], ddp["state"]) < 0.25 * _mean_abs(ddp["state"], initial)
