"""Pipeline plans, stage views and schedule checks (one process, no group)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import accel
from accel.errors import ConfigError
from accel.parallel.pipeline.schedules import SCHEDULES, check_schedule, schedule_spec
from accel.parallel.pipeline.split import (
    PassThrough,
    keep_stages,
    split_points,
    stage_plan,
    stage_view,
)
from tests import pipeline_models as pm


def test_units_follow_the_split_points_and_views_share_the_weights() -> None:
    model = pm.Stack()
    plan = stage_plan(model, split_points(model, "auto", 2))
    assert plan.units_of(0) == ("inp", "layers.0", "layers.1")
    assert plan.units_of(1) == ("layers.2", "layers.3", "head")
    assert split_points(model, 4, 4) == ["layers.1", "layers.2", "layers.3"]
    x = torch.randn(3, 4)
    with torch.no_grad():
        whole = model(x)
        staged = stage_view(model, plan, 1)(stage_view(model, plan, 0)(x))
    torch.testing.assert_close(staged, whole)
    view = stage_view(model, plan, 1)
    assert isinstance(view.inp, PassThrough) and view.head is model.head
    assert not isinstance(model.inp, PassThrough)  # the model itself is left as it was
    keep_stages(model, plan, [1])
    assert isinstance(model.inp, PassThrough) and isinstance(model.layers[0], PassThrough)
    assert sorted(model.state_dict())[0] == "head.bias"  # global names kept


def test_bad_plans_are_refused_before_anything_changes() -> None:
    model = pm.Stack()
    with pytest.raises(ConfigError, match=r"'layer.2', which is no module of Stack"):
        stage_plan(model, ["layer.2"])
    with pytest.raises(ConfigError, match="not in the model's order"):
        stage_plan(model, ["layers.3", "layers.1"])
    with pytest.raises(ConfigError, match="more stages than blocks"):
        split_points(model, "auto", 5)
    with pytest.raises(ConfigError, match="makes 3 stages, but the schedule runs 2"):
        split_points(model, ["layers.1", "layers.2"], 2)
    with pytest.raises(ConfigError, match="holds no parameters"):
        stage_plan(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU()), ["2"])
    with pytest.raises(ConfigError, match="must be a list of module names"):
        split_points(model, {"layers.1": 1}, 2)
    assert not isinstance(model.inp, PassThrough)


def test_a_weight_tied_across_stages_is_found_with_its_names_and_stages() -> None:
    from accel.parallel.pipeline.ties import find_ties

    model = pm.Stack()
    model.head.weight = model.inp.weight  # (8, 4) would not fit; the tie is what counts
    ties = find_ties(model, stage_plan(model, ["layers.2"]))  # no longer refused
    assert [(t.names, t.stages) for t in ties] == [(("inp.weight", "head.weight"), (0, 1))]
    assert find_ties(model, stage_plan(model, ["layers.0"]))[0].stages == (0, 1)
    assert find_ties(pm.Stack(), stage_plan(pm.Stack(), ["layers.2"])) == []


def test_schedules_check_their_microbatches_and_stages() -> None:
    assert {s.name for s in SCHEDULES.values()} == {
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
        "ZBVZeroBubble", "DualPipeV"}
    from torch.distributed.pipelining import schedules

    for spec in SCHEDULES.values():  # each name is one of torch's schedule classes
        assert schedules.get_schedule_class(spec.name).__name__ == spec.cls_name
    v = schedule_spec("zbvzerobubble")
    assert v.stages_of(0, 2, 2) == (0, 3) and v.stages_of(1, 2, 2) == (1, 2)
    assert schedule_spec("LoopedBFS").stages_of(1, 2, 3) == (1, 3, 5)
    assert check_schedule(schedule_spec("GPipe"), pp_size=4, stages_per_rank=None,
                          microbatches=1) == (1, 1)
    for name, options, words in (
        ("1F1B", {"microbatches": 3}, "microbatches=3 < 4 stages"),
        ("DualPipeV", {"microbatches": 7}, "microbatches=7 < 8 stages"),
        ("ZBVZeroBubble", {"microbatches": 8, "stages_per_rank": 3}, "exactly 2 stages"),
        ("GPipe", {"microbatches": 8, "stages_per_rank": 2}, "one stage per rank"),
        ("Interleaved1F1B", {"microbatches": 9}, "multiple of microbatches // pp_size"),
        ("GPipe", {"microbatches": 0}, "microbatches=0 must be an integer >= 1"),
    ):
        with pytest.raises(ConfigError, match=words):
            check_schedule(schedule_spec(name), pp_size=4,
                           stages_per_rank=options.get("stages_per_rank"),
                           microbatches=options["microbatches"])


def test_without_a_pp_dim_the_plan_is_checked_and_the_step_runs_the_whole_model() -> None:
    with accel.distributed():
        with pytest.raises(ConfigError, match="no module of Stack"):
            accel.prepare_model(pm.Stack(), pp_plan=["layers.9"])
        model = accel.prepare_model(pm.Stack(), pp_plan=["layers.2"], pp_schedule="GPipe")
        assert not isinstance(model.inp, PassThrough)
        x, y = pm.data()
        want = nn.functional.mse_loss(model(x[:8]), y[:8])
        loss = accel.pipeline_step(model, x[:8], y[:8], loss_fn=nn.functional.mse_loss)
        torch.testing.assert_close(loss, want.detach())
        assert not loss.requires_grad and model.head.weight.grad is not None


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
def test_auto_puts_embeddings_first_and_norm_and_head_last_on_llama() -> None:
    from tests import mesh_models

    model = mesh_models.llama()
    plan = stage_plan(model, split_points(model, "auto", 2))
    assert plan.units_of(0) == ("model.embed_tokens", "model.layers.0", "model.rotary_emb")
    assert plan.units_of(1) == ("model.layers.1", "model.norm", "model.rotary_emb", "lm_head")
