"""Mesh sizes, tensor-parallel plans and where the sizes come from (one process, no group)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import accel
from accel.core.mesh import MeshShape, mesh_shape
from accel.core.state import ProcessState
from accel.errors import ConfigError
from accel.launch.run import add_launch_options, command_line_settings
from accel.parallel.tp_plan import matching_modules, model_plan, to_style
from tests import mesh_models as mm


@pytest.mark.parametrize(
    ("world", "strategy", "sizes", "shape"),
    [
        (4, None, {"tp_size": 2}, (2, 1, 1, 2)),  # the rest replicates without fsdp
        (4, "fsdp", {"tp_size": 2}, (1, 2, 1, 2)),  # ... and shards under fsdp
        (4, None, {"dp_shard_size": 2, "tp_size": 2}, (1, 2, 1, 2)),
        (4, None, {"dp_shard_size": 2}, (2, 2, 1, 1)),  # HSDP: replicate takes what remains
        (4, None, {"dp_replicate_size": 2, "dp_shard_size": 2}, (2, 2, 1, 1)),
        (4, None, {"tp_size": 4}, (1, 1, 1, 4)),
        (8, None, {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, (2, 2, 1, 2)),
        (4, "fsdp", {"dp_replicate_size": 2}, (2, 2, 1, 1)),
        (4, None, {"cp_size": 1}, (4, 1, 1, 1)),
        (4, None, {"cp_size": 2}, (2, 1, 2, 1)),  # cp ranks: same batches, DDP average
        (4, "fsdp", {"cp_size": 2}, (1, 2, 2, 1)),
        (8, None, {"cp_size": 2, "dp_shard_size": 2, "tp_size": 2}, (1, 2, 2, 2)),
    ],
)
def test_one_unset_size_takes_what_remains(
    world: int, strategy: str | None, sizes: dict[str, int], shape: tuple[int, ...]
) -> None:
    got = mesh_shape(world, strategy, sizes)
    assert got is not None and got.sizes() == (1, *shape)


def test_no_sizes_no_mesh() -> None:
    assert mesh_shape(4, "fsdp", {}) is None
    assert mesh_shape(4, None, {"tp_size": None}) is None


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.booleans())
def test_the_product_is_always_the_world_size(r: int, s: int, t: int, fsdp: bool) -> None:
    world = r * s * t
    for sizes in ({"dp_shard_size": s, "tp_size": t}, {"dp_replicate_size": r, "tp_size": t},
                  {"tp_size": t}):
        if not fsdp and "dp_replicate_size" in sizes and s > 1:  # nothing may take the rest
            with pytest.raises(ConfigError, match="multiply to"):
                mesh_shape(world, None, sizes)
            continue
        shape = mesh_shape(world, "fsdp" if fsdp else None, sizes)
        assert shape is not None
        assert shape.dp_replicate * shape.dp_shard * shape.tp == world
        assert all(shape.sizes()[i + 1] == v for i, k in enumerate(
            ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")) if (v := sizes.get(k)))


@pytest.mark.parametrize(
    ("world", "strategy", "sizes", "words"),
    [
        (4, None, {"tp_size": 3}, "tp_size=3 (world_size=4) do not divide"),
        (6, None, {"tp_size": 4}, "tp_size=4 (world_size=6) do not divide"),
        (4, "ddp", {"dp_shard_size": 2}, "dp_shard_size=2 shards parameters with FSDP"),
        (4, "ddp", {"dp_replicate_size": 2}, "multiply to 2, not the world size 4"),
        (4, None, {"dp_replicate_size": 2, "dp_shard_size": 1, "tp_size": 1},
         "dp_replicate_size=2, dp_shard_size=1, tp_size=1 (world_size=4) multiply to 2"),
        (4, None, {"cp_size": 3}, "cp_size=3 (world_size=4) do not divide"),
        (4, None, {"tp_size": 0}, "tp_size=0 must be an integer >= 1"),
        (4, None, {"tp_size": True}, "tp_size=True must be an integer >= 1"),
    ],
)
def test_bad_sizes_name_every_size(
    world: int, strategy: str | None, sizes: dict[str, object], words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        mesh_shape(world, strategy, sizes)
    assert words in str(caught.value)


def test_one_process_block_has_no_mesh_and_ranks_follow_the_sizes() -> None:
    with accel.distributed() as state:
        assert state.mesh is None and state.mesh_shape is None
        assert (state.dp_rank, state.dp_world_size, state.tp_rank, state.tp_world_size) == (
            0, 1, 0, 1)
    with accel.distributed(tp_size=1, dp_shard_size=1) as state:
        assert state.mesh_shape == (1, 1, 1, 1, 1) and state.mesh is None
        with pytest.raises(ConfigError, match="the mesh is made once"), accel.distributed(
            tp_size=2
        ):
            pass
        with accel.distributed(tp_size=1) as inner:  # the same size: accepted
            assert inner.mesh_shape == (1, 1, 1, 1, 1)


def test_sizes_come_from_the_environment_and_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_TP_SIZE", "2")
    with pytest.raises(ConfigError, match=r"tp_size=2 \(world_size=1\)"), accel.distributed():
        pass
    monkeypatch.setenv("ACCEL_TP_SIZE", "two")
    with pytest.raises(ConfigError, match="ACCEL_TP_SIZE"), accel.distributed():
        pass
    parser = argparse.ArgumentParser()
    add_launch_options(parser)
    for flags in (["--tp-size", "2", "--dp-shard-size", "2", "--dp-replicate-size", "1"],
                  ["--tp_size", "2", "--dp_shard_size", "2", "--dp_replicate_size", "1"],
                  ["--parallelism_config_tp_size", "2", "--parallelism_config_dp_shard_size",
                   "2", "--parallelism_config_dp_replicate_size", "1"]):
        settings = command_line_settings(parser.parse_args(flags))
        assert settings == {"tp_size": 2, "dp_shard_size": 2, "dp_replicate_size": 1}


def test_plan_patterns_match_one_name_part_per_star() -> None:
    model = mm.MLP()
    assert matching_modules(model, mm.MLP_PLAN) == {
        "blocks.0.up": "colwise", "blocks.1.up": "colwise",
        "blocks.0.down": "rowwise", "blocks.1.down": "rowwise",
    }
    assert matching_modules(model, {"blocks.1.up": "rowwise", "blocks.*.up": "colwise"}) == {
        "blocks.1.up": "rowwise", "blocks.0.up": "colwise"}  # the first pattern wins
    with pytest.raises(ConfigError, match=r"'layers.\*.up' names no module of MLP "
                                          r"\(modules with that last name: \['blocks.0.up'"):
        matching_modules(model, {"layers.*.up": "colwise"})
    with pytest.raises(ConfigError, match="names no module"):
        matching_modules(model, {"*.up": "colwise"})  # one star is one part only


def test_styles_and_their_names() -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert type(to_style("colwise", "a")) is ColwiseParallel
    assert type(to_style("rowwise", "a")) is RowwiseParallel
    gathered = to_style("colwise_gather_output", "a")
    assert isinstance(gathered, ColwiseParallel) and gathered.output_layouts == (Replicate(),)
    embedding = to_style("embedding_rowwise", "a")
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)
    style = ColwiseParallel(use_local_output=False)
    assert to_style(style, "a") is style
    with pytest.raises(ConfigError, match=r"tp_plan\['experts'\] = 'grouped_gemm' is not a "
                                          "style accel can apply"):
        to_style("grouped_gemm", "experts")


def test_a_plan_of_the_wrong_kind_is_refused() -> None:
    with accel.distributed():
        with pytest.raises(ConfigError, match="must be 'auto' or a mapping"):
            accel.prepare_model(mm.MLP(), tp_plan="colwise")
        with pytest.raises(ConfigError, match="carries no tensor-parallel plan"):
            accel.prepare_model(nn.Linear(2, 2), tp_plan="auto")
        with pytest.raises(ConfigError, match="names no module"):  # checked on one process too
            accel.prepare_model(mm.MLP(), tp_plan={"blocks.*.gate": "colwise"})
        model = accel.prepare_model(mm.MLP(), tp_plan=mm.MLP_PLAN)  # no tp dim: left whole
        assert type(model.blocks[0].up.weight) is nn.Parameter


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
def test_auto_takes_a_transformers_models_own_plan() -> None:
    plan = model_plan(mm.llama())
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert {name for name in matching_modules(mm.llama(), plan)} >= {
        "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.up_proj"}
    for style in set(plan.values()):
        to_style(style, "x")  # every style Llama uses maps to a torch style


def test_mesh_shape_properties() -> None:
    shape = MeshShape(2, 2, 1, 2)
    assert shape.dp_size == 4 and shape.sizes() == (1, 2, 2, 1, 2)
    assert MeshShape(1, 2, 2, 1, pp=2).sizes() == (2, 1, 2, 2, 1)


@pytest.mark.parametrize(
    ("world", "strategy", "sizes", "shape"),
    [
        (2, None, {"pp_size": 2}, (2, 1, 1, 1, 1)),
        (4, None, {"pp_size": 2}, (2, 2, 1, 1, 1)),  # the rest replicates without fsdp
        (4, "fsdp", {"pp_size": 2}, (2, 1, 2, 1, 1)),  # ... and shards under fsdp
        (4, None, {"pp_size": 2, "dp_shard_size": 2}, (2, 1, 2, 1, 1)),
        (8, None, {"pp_size": 2, "tp_size": 2, "dp_shard_size": 2}, (2, 1, 2, 1, 2)),
        (8, "fsdp", {"pp_size": 2, "cp_size": 2}, (2, 1, 2, 2, 1)),  # cp inside each stage
        (16, None, {"pp_size": 2, "cp_size": 2, "tp_size": 2}, (2, 2, 1, 2, 2)),
    ],
)
def test_pp_is_the_outermost_dim(
    world: int, strategy: str | None, sizes: dict[str, int], shape: tuple[int, ...]
) -> None:
    got = mesh_shape(world, strategy, sizes)
    assert got is not None and got.sizes() == shape and got.pp == shape[0]


def test_bad_pp_sizes_are_refused_and_ranks_follow_the_mesh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=r"pp_size=3 \(world_size=4\) do not divide"):
        mesh_shape(4, None, {"pp_size": 3})
    with pytest.raises(ConfigError, match="pp_size=0 must be an integer >= 1"):
        mesh_shape(4, None, {"pp_size": 0})
    with pytest.raises(ConfigError, match=r"pp_size=2, dp_replicate_size=2 .world_size=8. mult"):
        mesh_shape(8, None, {"pp_size": 2, "dp_replicate_size": 2})
    with pytest.raises(ConfigError, match="pp_size"), accel.distributed(pp_sizes=2):
        pass
    monkeypatch.setenv("ACCEL_PP_SIZE", "2")
    with pytest.raises(ConfigError, match=r"pp_size=2 \(world_size=1\)"), accel.distributed():
        pass
    monkeypatch.delenv("ACCEL_PP_SIZE")
    with accel.distributed(pp_size=1) as state:
        assert state.mesh_shape == (1, 1, 1, 1, 1)
        assert (state.pp_rank, state.pp_world_size) == (0, 1)
    four = ProcessState(rank=3, world_size=4, mesh_shape=(2, 2, 1, 1, 1))
    assert (four.pp_rank, four.pp_world_size, four.dp_rank, four.dp_world_size) == (1, 2, 1, 2)
    eight = ProcessState(rank=5, world_size=8, mesh_shape=(2, 1, 2, 1, 2))
    assert (eight.pp_rank, eight.dp_rank, eight.dp_world_size, eight.tp_rank) == (1, 0, 2, 1)
    # pp x dp_shard x cp: a cp group's ranks share a dp_rank (the same batches) in each stage
    cp = [ProcessState(rank=r, world_size=8, mesh_shape=(2, 1, 2, 2, 1)) for r in range(8)]
    assert [(s.pp_rank, s.dp_rank, s.cp_rank) for s in cp] == [
        (p, d, c) for p in range(2) for d in range(2) for c in range(2)]
    assert {(s.dp_world_size, s.cp_world_size, s.pp_world_size, s.tp_world_size)
            for s in cp} == {(2, 2, 2, 1)}
    big = ProcessState(rank=13, world_size=16, mesh_shape=(2, 1, 2, 2, 2))
    assert (big.pp_rank, big.dp_rank, big.cp_rank, big.tp_rank) == (1, 1, 0, 1)
    parser = argparse.ArgumentParser()
    add_launch_options(parser)
    for flags in (["--pp-size", "2"], ["--pp_size", "2"]):
        assert command_line_settings(parser.parse_args(flags)) == {"pp_size": 2}


@pytest.mark.parametrize("key", ["pp_size", "cp_size", "tp_size"])
def test_deepspeed_with_a_pipeline_context_or_tensor_split_is_refused(key: str) -> None:
    # ZeRO partitions over every process: a tp/cp/pp mesh under it would be silently ignored
    with pytest.raises(ConfigError, match=rf"{key}=2 with strategy='deepspeed'.*strategy='fsdp'"):
        mesh_shape(4, "deepspeed", {key: 2})
    assert mesh_shape(4, "deepspeed", {"dp_replicate_size": 4}) == mesh_shape(
        4, None, {"dp_replicate_size": 4})
