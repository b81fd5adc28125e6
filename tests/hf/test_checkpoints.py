"""Real transformers models through accel's checkpoints: resume anywhere, load with transformers.

One launch of 2 processes trains every family with FSDP, and again with DDP, saves its state
(``save_state``: model, AdamW, transformers' warmup schedule) after SAVE_AT steps and takes
the next step (the uninterrupted run); the FSDP model's weights are then written with
``accel.save_model`` and with the no_trainer ``save_pretrained`` pattern. The FSDP state is
loaded by FSDP and DDP, the DDP state by FSDP, on 2 processes (same launch) and on 3 (one
more launch), and both by one process (the test process); each takes the next step, which
must equal the uninterrupted one (loss and every weight, 1e-5). The saved weights must load
with transformers' (or peft's) ``from_pretrained`` and give the trained model's logits.
"""

from __future__ import annotations

import os
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
    pytest.mark.slow,  # two launches (2 and 3 processes) for every family
    pytest.mark.filterwarnings("ignore:.*will be removed in v6:FutureWarning"),  # peft's calls
]

SAVE_AT = 2  # steps before save_state; the next step is global batch SAVE_AT
TOL = 1e-5
SAVERS = ("fsdp", "ddp")
RESUMES = [("fsdp", "fsdp"), ("fsdp", "ddp"), ("ddp", "fsdp")]  # (saved by, loaded by)


def _paths(root: str, family: str) -> dict[str, str]:
    base = os.path.join(root, family)
    names = ("state_fsdp", "state_ddp", "save_model", "no_trainer")
    return {k: os.path.join(base, k) for k in names}


def _attempt(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or its traceback as a string (loads fail on every rank alike)."""
    try:
        return fn(*args)
    except Exception:
        return traceback.format_exc()


def _prepared(family: str, seed: int) -> tuple[Any, Any, Any]:
    """Model, AdamW and transformers' warmup schedule through ``accel.prepare`` together (the
    optimizer is made before FSDP shards the model, as in Accelerate scripts)."""
    model = M.build(family, seed=seed)
    optimizer = M.optimizer(model)
    return accel.prepare(model, optimizer, M.schedule(optimizer))  # type: ignore[no-any-return]


def _resume(family: str, state_dir: str, strategy: str) -> dict[str, Any]:
    """A model with other initial weights loads the state and takes the next step."""
    with accel.distributed(strategy=strategy):
        model, optimizer, scheduler = _prepared(family, seed=7)
        info = accel.load_state(state_dir, model=model, optimizer=optimizer, scheduler=scheduler)
        assert info is not None and info.step == SAVE_AT
        loss = M.step(model, optimizer, family, SAVE_AT, scheduler=scheduler)
        weights = M.state(model)
    return {"loss": loss, "state": weights if accel.state().is_main_process else None}


def _save_weights(model: torch.nn.Module, family: str, paths: dict[str, str]) -> None:
    st = accel.state()
    inner = accel.unwrap_model(model)
    if st.is_main_process and family != "llama_lora":  # save_model writes the weights only
        M.config(family).save_pretrained(M.fresh_dir(paths["save_model"]))
    accel.save_model(model, paths["save_model"])
    # the no_trainer examples' pattern (transformers and peft alike)
    inner.save_pretrained(
        paths["no_trainer"],
        is_main_process=st.is_main_process,
        save_function=accel.save,
        state_dict=accel.get_state_dict(model),
    )
    accel.wait_for_everyone()


def _train_and_save(family: str, root: str) -> dict[str, Any]:
    """For each saving strategy: train, save_state, take the next step (the uninterrupted
    run); save the FSDP model's weights; resume each pair of RESUMES on these 2 processes."""
    paths = _paths(root, family)
    out: dict[str, Any] = {}
    for saver in SAVERS:
        with accel.distributed(strategy=saver):
            model, optimizer, scheduler = _prepared(family, seed=0)
            M.train(model, optimizer, family, range(SAVE_AT), scheduler=scheduler)
            accel.save_state(
                paths[f"state_{saver}"], step=SAVE_AT, model=model, optimizer=optimizer,
                scheduler=scheduler,
            )
            loss = M.step(model, optimizer, family, SAVE_AT, scheduler=scheduler)
            weights = M.state(model)
            if saver == "fsdp":
                out["saved"] = _attempt(_save_weights, model, family, paths)
        out[saver] = {"loss": loss, "state": weights if accel.state().is_main_process else None}
    out["resumed"] = _resumes(family, root)
    return out


def _resumes(family: str, root: str) -> dict[str, Any]:
    paths = _paths(root, family)
    return {
        f"{saver}->{loader}": _attempt(_resume, family, paths[f"state_{saver}"], loader)
        for saver, loader in RESUMES
    }


def _save_body(families: tuple[str, ...], root: str) -> dict[str, Any]:
    return {family: _attempt(_train_and_save, family, root) for family in families}


def _resume_body(families: tuple[str, ...], root: str) -> dict[str, Any]:
    return {family: _resumes(family, root) for family in families}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("hf_checkpoints"))
    return root, run_distributed(_save_body, M.FAMILIES, root, world_size=2, timeout=600)[0]


@pytest.fixture(scope="module")
def resumed_on_3(saved: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    root, _ = saved
    return run_distributed(_resume_body, M.FAMILIES, root, world_size=3, timeout=600)[0]


def _ok(value: Any, what: str) -> Any:
    if isinstance(value, str):
        pytest.fail(f"{what} raised:\n{value}")
    return value


def _trained(saved: tuple[str, dict[str, Any]], family: str) -> dict[str, Any]:
    return _ok(saved[1][family], f"training and saving {family!r} on 2 processes")  # type: ignore[no-any-return]


def _assert_next_step_equal(resumed: dict[str, Any], expected: dict[str, Any]) -> None:
    assert abs(resumed["loss"] - expected["loss"]) <= TOL, (resumed["loss"], expected["loss"])
    assert M.max_diff(resumed["state"], expected["state"]) <= TOL


families = pytest.mark.parametrize("family", M.FAMILIES)
resumes = pytest.mark.parametrize(("saver", "loader"), RESUMES)


@families
@resumes
def test_state_saved_on_2_resumes_on_2(
    saved: tuple[str, dict[str, Any]], family: str, saver: str, loader: str
) -> None:
    trained = _trained(saved, family)
    resumed = _ok(trained["resumed"][f"{saver}->{loader}"],
                  f"{loader} load_state of {family!r} ({saver} state) on 2")
    _assert_next_step_equal(resumed, trained[saver])


@families
@resumes
def test_state_saved_on_2_resumes_on_3(
    saved: tuple[str, dict[str, Any]], resumed_on_3: dict[str, Any], family: str, saver: str,
    loader: str,
) -> None:
    trained = _trained(saved, family)
    resumed = _ok(resumed_on_3[family][f"{saver}->{loader}"],
                  f"{loader} load_state of {family!r} ({saver} state) on 3")
    _assert_next_step_equal(resumed, trained[saver])


@families
@pytest.mark.parametrize("saver", SAVERS)
def test_state_saved_on_2_resumes_on_1(
    saved: tuple[str, dict[str, Any]], family: str, saver: str
) -> None:
    root, _ = saved
    trained = _trained(saved, family)
    with accel.distributed(), pytest.warns(UserWarning, match="RNG states are not restored"):
        resumed = _resume(family, _paths(root, family)[f"state_{saver}"], "fsdp")
    _assert_next_step_equal(resumed, trained[saver])


def _trained_logits(expected: dict[str, Any], family: str) -> torch.Tensor:
    model = M.build(family, seed=7)
    model.load_state_dict(expected["state"])
    return M.logits(model, family)


def _assert_logits(model: torch.nn.Module, expected: dict[str, Any], family: str) -> None:
    reference = _trained_logits(expected, family)
    got = M.logits(model, family)
    assert got.shape == reference.shape
    assert (got - reference).abs().max().item() <= TOL


@families
def test_save_model_loads_with_from_pretrained(
    saved: tuple[str, dict[str, Any]], family: str
) -> None:
    root, _ = saved
    trained = _trained(saved, family)
    _ok(trained["saved"], f"saving the weights of {family!r}")
    expected = trained["fsdp"]
    directory = _paths(root, family)["save_model"]
    if family == "llama_lora":
        # the full peft state dict (base and adapters): a fresh peft model loads it
        model = M.build(family, seed=7)
        accel.load_checkpoint_in_model(model, directory, strict=True)
    else:
        model = M.model_class(family).from_pretrained(directory)
    _assert_logits(model, expected, family)


@families
def test_no_trainer_save_pretrained_loads_with_from_pretrained(
    saved: tuple[str, dict[str, Any]], family: str
) -> None:
    import peft

    root, _ = saved
    trained = _trained(saved, family)
    _ok(trained["saved"], f"saving the weights of {family!r}")
    expected = trained["fsdp"]
    directory = _paths(root, family)["no_trainer"]
    if family == "llama_lora":
        # adapters only, as peft writes them; the frozen base is the seed-0 Llama
        base = M.build("llama_tied")
        model = peft.PeftModel.from_pretrained(base, directory)
        assert "adapter_model.safetensors" in os.listdir(directory)
    else:
        model = M.model_class(family).from_pretrained(directory)
    _assert_logits(model, expected, family)

