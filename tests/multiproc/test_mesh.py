"""Training on N-D meshes (TP, TP x FSDP, HSDP, TP x replicas) equals one process.

Every run trains the same model on the same global batches (fp32) and compares with one
process: the full weights after the steps, each step's global gradient norm and loss, and the
predictions ``gather_for_metrics`` returns (each sample once, in order). Checkpoints saved on
a TP2 x FSDP2 mesh resume on other meshes and in a plain single-process model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.testing import run_distributed
from tests import mesh_models as mm

_NO_HF = importlib.util.find_spec("transformers") is None


def HF(test: Any) -> Any:
    """Skip without transformers; the workers get transformers' Llama from the warm server."""
    test = pytest.mark.skipif(_NO_HF, reason="transformers not installed")(test)
    return pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama")(test)
MESHES = {
    "tp2xfsdp2": {"tp_size": 2, "dp_shard_size": 2},
    "hsdp2x2": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "tp4": {"tp_size": 4},
    "tp2xreplicate2": {"tp_size": 2, "dp_replicate_size": 2},
}
SHAPES = {
    "tp2xfsdp2": (1, 1, 2, 1, 2), "hsdp2x2": (1, 2, 2, 1, 1), "tp4": (1, 1, 1, 1, 4),
    "tp2xreplicate2": (1, 2, 1, 1, 2),
}
_REFERENCE: dict[tuple[Any, ...], dict[str, Any]] = {}


def _one_process(family: str, steps: int = 3, gas: int = 1) -> dict[str, Any]:
    key = (family, steps, gas)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_distributed(
            mm.train, family, steps, world_size=1, timeout=240, gradient_accumulation_steps=gas
        )[0]
    return _REFERENCE[key]


def _assert_same(got: dict[str, Any], want: dict[str, Any], atol: float = 1e-5) -> None:
    assert got["weights"].keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=atol, rtol=1e-5, msg=name)
    assert got["norms"] == pytest.approx(want["norms"], abs=1e-5)
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    assert got["predictions"].shape == want["predictions"].shape  # each sample once
    torch.testing.assert_close(got["predictions"], want["predictions"], atol=atol, rtol=1e-5)


@pytest.mark.parametrize(
    "mesh", [pytest.param(m, marks=pytest.mark.ci_extra) if m == "tp2xfsdp2"  # >=5.7 s
             else pytest.param(m, marks=[pytest.mark.slow, pytest.mark.ci_extra])
             if m == "tp2xreplicate2" else pytest.param(m, marks=pytest.mark.slow)
             for m in MESHES]
)
def test_mlp_on_a_mesh_equals_one_process(mesh: str) -> None:
    out = run_distributed(mm.train, "mlp", world_size=4, timeout=240, **MESHES[mesh])
    _assert_same(out[0], _one_process("mlp"))
    shape = SHAPES[mesh]
    assert [o["mesh"] for o in out] == [shape] * 4
    tp = shape[-1]  # the innermost dim
    assert [o["tp"] for o in out] == [(r % tp, tp) for r in range(4)]
    assert [o["dp"] for o in out] == [(r // tp, 4 // tp) for r in range(4)]
    for other in out[1:]:  # every rank sees the same global results
        assert other["losses"] == out[0]["losses"]
        torch.testing.assert_close(other["predictions"], out[0]["predictions"])


def test_tensor_parallel_on_two_processes_equals_one_process() -> None:
    out = run_distributed(mm.train, "mlp", world_size=2, timeout=240, tp_size=2)
    _assert_same(out[0], _one_process("mlp"))
    assert [o["dp"] for o in out] == [(0, 1), (0, 1)]


@pytest.mark.slow
def test_accumulation_and_activation_checkpointing_on_tp_x_fsdp() -> None:
    want = _one_process("mlp", steps=4, gas=2)
    out = run_distributed(
        mm.train_checkpointed, "mlp", 4, world_size=4, timeout=240,
        gradient_accumulation_steps=2, **MESHES["tp2xfsdp2"],
    )
    _assert_same(out[0], want)
    assert len(out[0]["norms"]) == 2  # clipped on the two sync steps


@HF
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["tp2xfsdp2", "tp4", "tp2xreplicate2"])
@pytest.mark.ci_extra
def test_llama_with_its_own_plan_equals_one_process(mesh: str) -> None:
    out = run_distributed(mm.train, "llama", world_size=4, timeout=300, **MESHES[mesh])
    _assert_same(out[0], _one_process("llama"))


@HF
def test_tied_llama_keeps_its_tie_under_tensor_parallel() -> None:
    out = run_distributed(mm.train, "llama-tied", world_size=2, timeout=300, tp_size=2)
    want = _one_process("llama-tied")
    _assert_same(out[0], want)
    assert "lm_head.weight" not in want["weights"] or torch.equal(
        out[0]["weights"]["lm_head.weight"], out[0]["weights"]["model.embed_tokens.weight"]
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mesh_ckpt")
    run_distributed(mm.train, "mlp", 3, None, str(root / "ref"), world_size=1, timeout=240)
    want = run_distributed(
        mm.train, "mlp", 3, None, None, str(root / "ref"), world_size=1, timeout=240
    )[0]
    saved = run_distributed(mm.train, "mlp", 3, None, str(root / "tp2xfsdp2"), world_size=4,
                            timeout=240, **MESHES["tp2xfsdp2"])[0]
    return {"root": root, "want": want, "saved": saved}


@pytest.mark.parametrize(
    ("world", "sizes"),
    [pytest.param(1, {}, marks=pytest.mark.slow), (4, {"dp_shard_size": 4}),
     pytest.param(4, MESHES["hsdp2x2"], marks=pytest.mark.slow),
     pytest.param(4, MESHES["tp4"], marks=pytest.mark.slow), (2, {"tp_size": 2}),
     pytest.param(4, MESHES["tp2xfsdp2"], marks=pytest.mark.slow)],
    ids=["plain-1", "fsdp4", "hsdp2x2", "tp4", "tp2", "tp2xfsdp2"],
)
def test_tp_x_fsdp_checkpoint_resumes_on_any_mesh(
    saved: dict[str, Any], world: int, sizes: dict[str, int]
) -> None:
    out = run_distributed(
        mm.train, "mlp", 3, None, None, str(saved["root"] / "tp2xfsdp2"), world_size=world,
        timeout=240, **sizes,
    )
    _assert_same(out[0], saved["want"])


def test_each_piece_is_written_once(saved: dict[str, Any]) -> None:
    """Layers left whole are FSDP-sharded identically on both TP ranks: stored once."""
    import json

    root: Path = saved["root"] / "tp2xfsdp2"
    seen: dict[str, list[tuple[list[int], list[int]]]] = {}
    for rank in range(4):
        meta = json.loads((root / f"model__shards_rank{rank}.json").read_text())
        for key, where in meta["extra"]["pieces"].items():
            seen.setdefault(key, []).append((where["offset"], where["shape"]))
    assert seen["inp.weight"] == [([0, 0], [8, 8]), ([8, 0], [8, 8])]  # dp_shard pieces only
    up = sorted(seen["blocks.0.up.weight"])
    assert len(up) == 4 and len({tuple(o) for o, _ in up}) == 4  # TP x FSDP: 4 distinct


@pytest.mark.parametrize("mesh", ["tp2xfsdp2", "tp4", "tp2xreplicate2"])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(mesh: str) -> None:
    """An inf in one rank's piece of a layer left whole (FSDP-sharded over dp_shard only, so
    torch's own check reduces over half the ranks): every rank skips, no weight changes."""
    out = run_distributed(mm.overflow_on_one_rank, 1, world_size=4, timeout=240,
                          mixed_precision="fp16", **MESHES[mesh])
    assert out == [{"skipped": True, "changed": False}] * 4


@pytest.mark.slow
@pytest.mark.ci_extra
def test_mixed_precision_on_tp_x_fsdp_trains_close_to_one_process() -> None:
    want = _one_process_mixed("bf16")
    out = run_distributed(mm.train, "mlp", world_size=4, timeout=240, mixed_precision="bf16",
                          **MESHES["tp2xfsdp2"])
    assert out[0]["losses"] == pytest.approx(want["losses"], rel=5e-3)
    assert out[0]["norms"] == pytest.approx(want["norms"], rel=5e-3)


def _one_process_mixed(mixed_precision: str) -> dict[str, Any]:
    return run_distributed(mm.train, "mlp", world_size=1, timeout=240,
                           mixed_precision=mixed_precision)[0]


def test_save_model_on_a_mesh_writes_the_full_weights(saved: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    weights_dir = saved["root"] / "tp2xfsdp2_weights"
    files = sorted(weights_dir.glob("*.safetensors"))
    assert files, sorted(weights_dir.iterdir())
    written: dict[str, torch.Tensor] = {}
    for file in files:
        written.update(load_file(file))
    assert written.keys() == saved["saved"]["weights"].keys()
    for name, value in saved["saved"]["weights"].items():
        torch.testing.assert_close(written[name], value, atol=0, rtol=0, msg=name)
    model = mm.make("mlp")
    model.load_state_dict(written)  # a plain model takes them as they are


@pytest.mark.slow  # 8 runs
@pytest.mark.ci_extra  # ~8 s
def test_a_checkpoint_travels_2x2_to_4x1_to_1_to_2x2(tmp_path: Path) -> None:
    """Each stage resumes the previous stage's checkpoint on another mesh, trains and saves;
    one process doing the same stages ends with the same weights."""
    stages = [(4, MESHES["tp2xfsdp2"]), (4, {"dp_shard_size": 4}), (1, {}),
              (4, MESHES["hsdp2x2"])]
    want: dict[str, Any] = {}
    got: dict[str, Any] = {}
    for i, (world, sizes) in enumerate(stages):
        load = None if i == 0 else str(tmp_path / f"ref{i - 1}")
        want = run_distributed(mm.chain, "mlp", 2, str(tmp_path / f"ref{i}"), load,
                               world_size=1, timeout=240)[0]
        load = None if i == 0 else str(tmp_path / f"mesh{i - 1}")
        got = run_distributed(mm.chain, "mlp", 2, str(tmp_path / f"mesh{i}"), load,
                              world_size=world, timeout=240, **sizes)[0]
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-5), i
    _assert_same(got, want)


@pytest.mark.slow  # compiles every block on 4 processes
@pytest.mark.ci_extra
def test_regional_compile_on_tp_x_fsdp_equals_one_process() -> None:
    out = run_distributed(mm.train_compiled, "mlp", 3, world_size=4, timeout=300,
                          **MESHES["tp2xfsdp2"])
    _assert_same(out[0], _one_process("mlp"))


@pytest.mark.parametrize(
    "mesh", ["tp2", pytest.param("tp2xfsdp2", marks=[pytest.mark.slow, pytest.mark.ci_extra])]
)
def test_a_foreach_optimizer_steps_plain_and_dtensor_parameters_together(mesh: str) -> None:
    """Without FSDP the head stays a plain tensor beside the TP blocks' DTensors: torch's
    foreach step refuses that mix unless the plain ones count as replicated."""
    sizes = {"tp_size": 2} if mesh == "tp2" else MESHES[mesh]
    out = run_distributed(mm.train_foreach, "mlp", 3, world_size=2 if mesh == "tp2" else 4,
                          timeout=240, **sizes)
    _assert_same(out[0], _one_process("mlp"))


@pytest.mark.parametrize("dispatch", [False, True], ids=["sharded", "dispatched"])
def test_a_tp_group_sees_the_same_batches_and_metrics_count_each_sample_once(
    dispatch: bool,
) -> None:
    out = run_distributed(mm.loader_batches, dispatch, world_size=4, timeout=240,
                          **MESHES["tp2xfsdp2"])
    assert out[0]["mine"] == out[1]["mine"] and out[2]["mine"] == out[3]["mine"]  # TP pairs
    assert out[0]["mine"] != out[2]["mine"]  # the data-parallel ranks share the batches out
    for result in out:
        assert result["all"] == [float(i) for i in range(11)]  # every sample once, in order


@pytest.mark.slow
@HF
@pytest.mark.ci_extra
def test_prepare_splits_a_transformers_model_by_its_own_plan() -> None:
    """accel.prepare(model, optimizer, loader) under tp_size=2: no tp_plan given, the Llama is
    split by its own plan, the optimizer made before is moved onto the split parameters."""
    want = run_distributed(mm.prepare_all_at_once, "llama", 3, world_size=1, timeout=300)[0]
    out = run_distributed(mm.prepare_all_at_once, "llama", 3, world_size=4, timeout=300,
                          **MESHES["tp2xfsdp2"])
    assert out[0]["split"] and not want["split"]
    assert out[0]["losses"] == pytest.approx(want["losses"], abs=1e-5)
    for name, value in want["weights"].items():
        torch.testing.assert_close(out[0]["weights"][name], value, atol=1e-5, rtol=1e-5)


def test_a_model_without_a_plan_stays_whole_and_says_so() -> None:
    out = run_distributed(mm.without_plan, world_size=2, timeout=240, tp_size=2)
    assert [o["split"] for o in out] == [False, False]
    for result in out:
        assert len(result["said"]) == 1
        assert "MLP has no tp_plan: it is not split" in result["said"][0]


def test_inspect_shows_the_mesh_a_checkpoint_was_saved_on(
    saved: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from accel.cli.main import main

    checkpoint = str(saved["root"] / "tp2xfsdp2")
    assert main(["checkpoint", "inspect", checkpoint, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"]["sizes"] == {
        "pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert main(["checkpoint", "inspect", checkpoint]) == 0
    shown = capsys.readouterr().out
    assert "mesh: 5-D (pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2) over 4 ranks" in shown
    assert main(["checkpoint", "verify", checkpoint]) == 0
