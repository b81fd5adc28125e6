"""Pipeline parallelism (``pp_size``) equals one process, on 2 and 4 gloo processes.

Every run trains the same model on the same batches (fp32) through ``accel.pipeline_step``
with clipping (the global norm over the stages) and compares with one process running the same
loop unsplit: each step's loss and gradient norm, and the weights after 3 AdamW steps (the
stages' weights merged by their global names).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.testing import run_distributed
from tests import pipeline_models as pm

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV"]
_REFERENCE: dict[Any, dict[str, Any]] = {}


def _one_process(family: str = "stack", gas: int = 1) -> dict[str, Any]:
    key = (family, gas)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_distributed(
            pm.train, family, world_size=1, timeout=120, gradient_accumulation_steps=gas
        )[0]
    return _REFERENCE[key]


def _assert_same(out: list[dict[str, Any]], want: dict[str, Any], atol: float = 1e-5) -> None:
    got = pm.merged(out)
    assert got.keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=1e-5, msg=name)
    for result in out:  # every rank: the same loss and norm as one process, all weights
        assert list(result["full"]) == list(want["full"])  # the unsplit model's order
        for name, value in want["weights"].items():
            torch.testing.assert_close(result["full"][name], value, atol=atol, rtol=1e-5)
        assert result["losses"] == pytest.approx(want["losses"], abs=atol)
        assert result["norms"] == pytest.approx(want["norms"], abs=atol)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_on_two_stages_equals_one_process(schedule: str) -> None:
    out = run_distributed(pm.train_with, schedule, world_size=2, timeout=120, pp_size=2)
    assert [o["pp"] for o in out] == [(0, 2), (1, 2)]
    _assert_same(out, _one_process())
    assert all(out[0]["weights"].keys().isdisjoint(o["weights"].keys()) for o in out[1:])


@pytest.mark.ci_extra
def test_four_stages_and_pp_x_fsdp_with_accumulation_equal_one_process() -> None:
    four = run_distributed(pm.train_deep, "Interleaved1F1B", world_size=4, timeout=120,
                           pp_size=4)
    _assert_same(four, _one_process("deep"))
    both = run_distributed(pm.train_with, "1F1B", world_size=4, timeout=120, pp_size=2,
                           dp_shard_size=2, gradient_accumulation_steps=2)
    assert [o["pp"] for o in both] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    _assert_same(both[::2], _one_process(gas=2))  # dp ranks of a stage hold the same weights


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_runs_on_every_stage(mode: str) -> None:
    out = run_distributed(pm.train_with, "1F1B", world_size=2, timeout=120, pp_size=2,
                          mixed_precision=mode)  # fp16: every stage's scaler in step
    want = _one_process()
    assert out[0]["losses"] == out[1]["losses"]
    assert out[0]["losses"] == pytest.approx(want["losses"], abs=0.02)
    got = pm.merged(out)
    assert max(float((got[k] - v).abs().max()) for k, v in want["weights"].items()) < 0.1


def test_zero_bubble_schedules_with_fsdp_and_bad_plans_are_refused() -> None:
    out = run_distributed(pm.refusals, world_size=2, timeout=120, pp_size=2)
    said = out[0]
    assert out[1] == said
    assert "'layers.9', which is no module of Stack" in said["no module"]
    assert "more stages than blocks" in said["more stages than blocks"]
    assert "'DualPipeV' needs at least as many microbatches as stages" in (
        said["dualpipev microbatches"])
    assert "microbatches=1 < 2 stages" in said["1f1b microbatches"]
    assert "Did you mean '1F1B'" in said["unknown schedule"]
    assert "compile=True) compiles the whole model, which a pipeline never" in (
        said["whole compile"])
    assert "batch of 6 samples does not split into microbatches=4" in said["batch"]
    fsdp = run_distributed(pm.refused_with_fsdp, world_size=4, timeout=120, pp_size=2,
                           dp_shard_size=2)
    assert all("'ZBVZeroBubble' splits each backward" in f and "FSDP" in f for f in fsdp)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama")
def test_a_transformers_llama_split_auto_equals_one_process() -> None:
    out = run_distributed(pm.train_llama, "1F1B", world_size=2, timeout=120, pp_size=2)
    first, last = (set(o["weights"]) for o in out)
    assert "model.embed_tokens.weight" in first and "model.layers.0.mlp.up_proj.weight" in first
    assert {"model.norm.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight"} <= last
    _assert_same(out, _one_process("llama"), atol=5e-5)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama",
                     "transformers.models.gpt2.modeling_gpt2")
@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.ci_extra), "llama-tied"])
def test_an_lm_head_tied_to_the_embedding_trains_on_two_stages_and_resumes_on_one(
    family: str, tmp_path: Path,
) -> None:
    # the tie spans both stages: each keeps a copy, their gradients summed after each step
    want = run_distributed(pm.chain, 4, 0, None, None, None, family, 3, world_size=1,
                           timeout=120)[0]  # one process, 4 steps (weights after 3 kept)
    saved = str(tmp_path / "pp2")
    out = run_distributed(pm.chain, 3, 0, saved, None, "1F1B", family, world_size=2,
                          timeout=120, pp_size=2)
    head, embed = "lm_head.weight", pm.embedding_name(family)
    assert embed in out[0]["weights"] and head in out[1]["weights"]  # a copy on each stage
    for result in out:
        assert list(result["full"]) == list(want["at"])  # both names, as one process has
        for name, value in want["at"].items():
            _assert_close_lm(name, result["full"][name], value)
        assert result["losses"] == pytest.approx(want["losses"][:3], abs=1e-5)
        assert result["norms"] == pytest.approx(want["norms"][:3], abs=1e-5)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "pp2_weights" / "model.safetensors"))
    assert embed in weights and head not in weights  # as save_model writes one process's tie
    one = run_distributed(pm.chain, 1, 3, None, saved, None, family, world_size=1,
                          timeout=120)[0]  # the PP2 checkpoint resumed on one process
    assert one["losses"] == pytest.approx(want["losses"][3:], abs=1e-5)
    for name, value in want["full"].items():
        _assert_close_lm(name, one["full"][name], value)


def _assert_close_lm(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """1e-5, but GPT-2's attention key bias (the middle third of ``c_attn.bias``) to 1e-4:
    its gradient is zero but for rounding (softmax ignores a shift shared by every score),
    which AdamW turns into lr-sized steps, so any summation order moves it (~1.3e-5)."""
    if name.endswith("attn.c_attn.bias"):
        third = want.shape[0] // 3
        key = slice(third, 2 * third)
        torch.testing.assert_close(got[key], want[key], atol=1e-4, rtol=0, msg=name)
        got, want = torch.cat([got[:third], got[2 * third:]]), torch.cat(
            [want[:third], want[2 * third:]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.ci_extra
def test_a_pp2_checkpoint_resumes_on_one_process_and_on_another_pipeline(
    tmp_path: Path,
) -> None:
    want = run_distributed(pm.train, "stack", 4, world_size=1, timeout=120)[0]
    saved = str(tmp_path / "pp2")
    run_distributed(pm.chain, 3, 0, saved, None, "1F1B", world_size=2, timeout=120, pp_size=2)
    from safetensors.torch import load_file

    from accel.cli.main import main

    assert main(["checkpoint", "verify", saved]) == 0  # every stage's pieces, each key once

    weights = load_file(str(tmp_path / "pp2_weights" / "model.safetensors"))
    assert weights.keys() == want["weights"].keys()  # save_model: every stage's weights
    one = run_distributed(pm.chain, 1, 3, None, saved, None, world_size=1, timeout=120)[0]
    assert one["losses"] == pytest.approx(want["losses"][3:], abs=1e-5)
    for name, value in want["weights"].items():
        torch.testing.assert_close(one["weights"][name], value, atol=1e-5, rtol=1e-5)
    v_shape = run_distributed(pm.chain, 1, 3, None, saved, "ZBVZeroBubble", world_size=2,
                              timeout=120, pp_size=2)  # 4 stages in a V: other owners
    _assert_same(v_shape, {**want, "losses": want["losses"][3:], "norms": want["norms"][3:]})
    plain = str(tmp_path / "one")  # and a one-process checkpoint into a pipeline
    run_distributed(pm.chain, 3, 0, plain, None, None, world_size=1, timeout=120)
    into = run_distributed(pm.chain, 1, 3, None, plain, "1F1B", world_size=2, timeout=120,
                           pp_size=2)
    _assert_same(into, {**want, "losses": want["losses"][3:], "norms": want["norms"][3:]})
    both = run_distributed(pm.chain, 1, 3, None, saved, "1F1B", world_size=4, timeout=120,
                           pp_size=2, dp_shard_size=2)  # into FSDP shards inside the stages
    _assert_same(both[::2], {**want, "losses": want["losses"][3:], "norms": want["norms"][3:]})
    sharded = str(tmp_path / "pp2xfsdp2")  # FSDP pieces inside each stage
    run_distributed(pm.chain, 3, 0, sharded, None, "1F1B", world_size=4, timeout=120,
                    pp_size=2, dp_shard_size=2)
    again = run_distributed(pm.chain, 1, 3, None, sharded, None, world_size=1, timeout=120)[0]
    assert again["losses"] == pytest.approx(want["losses"][3:], abs=1e-5)
    for name, value in want["weights"].items():
        torch.testing.assert_close(again["weights"][name], value, atol=1e-5, rtol=1e-5)


@pytest.mark.ci_extra
@pytest.mark.slow
def test_a_checkpoint_hops_pp2_x_fsdp2_to_one_to_pp4_to_pp2_x_tp2(tmp_path: Path) -> None:
    # each hop loads the previous hop's checkpoint and its next step equals one process's
    # (four launches, 4 + 1 + 4 + 4 processes: ~9 s)
    want = run_distributed(pm.hop, 4, 0, None, None, world_size=1, timeout=120)[0]
    hops: list[tuple[int, dict[str, int]]] = [
        (4, {"pp_size": 2, "dp_shard_size": 2}), (1, {}), (4, {"pp_size": 4}),
        (4, {"pp_size": 2, "tp_size": 2})]
    load = None
    for i, (world, sizes) in enumerate(hops):
        steps, start = 1, i
        save = str(tmp_path / f"hop{i}") if i < len(hops) - 1 else None
        out = run_distributed(pm.hop, steps, start, save, load, world_size=world,
                              timeout=120, **sizes)
        for result in out:
            assert result["losses"] == pytest.approx(want["losses"][start:start + steps],
                                                     abs=1e-5), (i, sizes)
            assert result["norms"] == pytest.approx(want["norms"][start:start + steps],
                                                    abs=1e-5), (i, sizes)
        load = save
    assert {"layers.0.up.weight", "layers.1.down.weight"} <= set(out[0]["tp"])
    assert {"layers.3.up.weight", "head.weight"}.isdisjoint(out[0]["tp"])  # the other stage's
    _assert_same(out, {**want, "losses": want["losses"][3:], "norms": want["norms"][3:]})


@pytest.mark.ci_extra
def test_activation_checkpointing_and_an_optimizer_made_before_equal_one_process() -> None:
    out = run_distributed(pm.train_checkpointed, "Interleaved1F1B", world_size=2,
                          timeout=120, pp_size=2)
    _assert_same(out, _one_process())
    for world, sizes in ((2, {}), (4, {"dp_shard_size": 2})):  # "auto" and 1F1B by default
        together = run_distributed(pm.train_prepared_together, world_size=world, timeout=120,
                                   pp_size=2, **sizes)
        _assert_same(together[:: world // 2], _one_process())


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama")
@pytest.mark.ci_extra
def test_pp2_x_tp2_llama_equals_one_process_and_its_checkpoint_resumes_on_one(
    tmp_path: Path,
) -> None:
    # TP inside each stage (the model's own plan), the norm over stages and TP shards
    want = run_distributed(pm.train_llama_tp, 4, 0, None, None, 3, world_size=1,
                           timeout=120)[0]  # 4 steps, the weights after 3 kept
    saved = str(tmp_path / "pp2xtp2")
    out = run_distributed(pm.train_llama_tp, 3, 0, saved, world_size=4, timeout=120,
                          pp_size=2, tp_size=2)
    assert [o["pp"] for o in out] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"} <= set(
        out[0]["tp"])
    assert {"lm_head.weight", "model.layers.1.self_attn.o_proj.weight"} <= set(out[2]["tp"])
    assert "model.norm.weight" not in out[2]["tp"]  # left whole, as the plan leaves it
    _assert_same(out, {"weights": want["at"], "full": want["at"],
                       "losses": want["losses"][:3], "norms": want["norms"][:3]})
    one = run_distributed(pm.train_llama_tp, 1, 3, None, saved, world_size=1,
                          timeout=120)[0]  # the PP2 x TP2 checkpoint on one process
    assert one["losses"] == pytest.approx(want["losses"][3:], abs=1e-5)
    for name, value in want["full"].items():
        torch.testing.assert_close(one["full"][name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.ci_extra
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama")
@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_pp2_x_tp2_x_fsdp2_llama_on_8_ranks_equals_one_process(family: str) -> None:
    # 3-D: TP inside each stage, FSDP over TP's DTensors, the pipeline over both (~12 s each)
    want = run_distributed(pm.train_llama_tp, 3, 0, None, None, None, family, world_size=1,
                           timeout=120)[0]
    out = run_distributed(pm.train_llama_tp, 3, 0, None, None, None, family, world_size=8,
                          timeout=300, pp_size=2, dp_shard_size=2, tp_size=2)
    assert [o["pp"] for o in out] == [(0, 2)] * 4 + [(1, 2)] * 4
    assert "model.layers.0.mlp.up_proj.weight" in out[0]["tp"]
    # tied: the weights to 1e-4. Losses and norms agree to ~1e-6 and every gradient to ~4e-8
    # (fp32 summation order: microbatches, TP shards, the copies' sum); AdamW's first step,
    # lr * g / (|g| + eps) with eps 1e-8, turns the rounding of the few elements whose
    # gradient is ~1e-8 (one of up_proj's 2048: 1.95e-8 here, 1.99e-8 split) into ~5e-5,
    # while every element with |g| > 1e-6 is within 4e-9 (docs/parallelism.md)
    _assert_same(out, {**want, "weights": want["full"]},  # the tie under both names
                 atol=1e-4 if family == "llama-tied" else 1e-5)
    if family == "llama-tied":
        assert max(abs(a - b) for o in out for a, b in zip(o["losses"], want["losses"],
                                                           strict=True)) < 1e-5
        assert max(abs(a - b) for o in out for a, b in zip(o["norms"], want["norms"],
                                                           strict=True)) < 1e-5


@pytest.mark.ci_extra
def test_regional_compile_compiles_each_stages_blocks_and_equals_one_process() -> None:
    out = run_distributed(pm.train_compiled, "1F1B", world_size=2, timeout=120, pp_size=2)
    assert [o["compiled"] for o in out] == [["layers.0", "layers.1"],
                                             ["layers.2", "layers.3"]]
    _assert_same(out, _one_process())


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama")
@pytest.mark.slow
@pytest.mark.ci_extra  # compiling each block takes 6-10 s
@pytest.mark.parametrize("pp", [1, 2])
def test_regional_compile_with_tp_equals_one_process_inside_stages_too(pp: int) -> None:
    # the embedding's TP output reaches the first compiled block as a plain tensor (it was
    # torch's AsyncCollectiveTensor, whose gradient AOTAutograd routed past the reduction:
    # the backward failed, with or without a pipeline)
    out = run_distributed(pm.compiled_llama_tp, world_size=2 * pp, timeout=180, pp_size=pp,
                          tp_size=2)
    assert all(o["compiled"] for o in out)
    _assert_same(out, _one_process("llama"), atol=5e-5)


def test_pp_x_cp_ranks_follow_the_mesh_and_prepare_model_refuses_the_pair() -> None:
    out = run_distributed(pm.refused_with_cp, world_size=4, timeout=120, pp_size=2, cp_size=2)
    assert all(o["mesh"] == (2, 1, 1, 2, 1) for o in out)
    assert out[0]["dims"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    # (pp_rank, dp_rank, cp_rank, tp_rank): a cp group shares its dp_rank (the same batches)
    assert [o["ranks"] for o in out] == [(0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 1, 0)]
    assert all(o["sizes"] == (2, 1, 2) for o in out)
    assert all("(pp_size=2) with context parallelism (cp_size=2) is not available" in o["said"]
               for o in out)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
@pytest.mark.ci_extra
def test_fp8_converts_each_stages_linear_layers() -> None:
    out = run_distributed(pm.fp8_stages, world_size=2, timeout=120, pp_size=2,
                          mixed_precision="fp8")
    assert out[0]["float8"] == ["layers.0.down", "layers.0.up", "layers.1.down", "layers.1.up"]
    assert out[1]["float8"] == ["layers.2.down", "layers.2.up", "layers.3.down", "layers.3.up"]
    one = run_distributed(pm.fp8_stages, world_size=1, timeout=120, mixed_precision="fp8")[0]
    assert len(one["float8"]) == 8  # the input layer (4 wide) and the 2-wide head stay
    assert out[0]["losses"] == out[1]["losses"]
    assert out[0]["losses"] == pytest.approx(one["losses"], abs=0.02)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_outputs_for_metrics_and_pipeline_forward_equal_one_process(schedule: str) -> None:
    # the last stage's outputs on every rank: gather_for_metrics, pipeline_forward (another
    # batch shape, a batch of one) and pipeline_step under no_grad equal one process's
    if "outputs" not in _REFERENCE:
        _REFERENCE["outputs"] = run_distributed(pm.outputs_and_forward, world_size=1,
                                                timeout=120)[0]
    want = _REFERENCE["outputs"]
    out = run_distributed(pm.outputs_and_forward, schedule, world_size=2, timeout=120,
                          pp_size=2)
    for got in out:
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
        for key in ("gathered", "forward", "whole"):
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=key)
        assert got["eval"][0] == pytest.approx(want["eval"][0], abs=1e-5)
        torch.testing.assert_close(got["eval"][1], want["eval"][1], atol=1e-5, rtol=1e-5)
    assert want["forward"].shape == (12, 2) and want["gathered"][0].shape == (8, 2)
