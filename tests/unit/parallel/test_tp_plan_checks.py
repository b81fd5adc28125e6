"""A tensor-parallel plan is checked against the modules it names before anything is split.

``check_plan(model, plan, tp_size)`` is what ``prepare_model(tp_plan=...)`` runs on every
rank (it reads only the model and the plan, so every rank refuses alike, before any
collective): each style fits its module's type, the dimensions it splits share out over
``tp_size`` ranks, and a column split feeding a row split hands over the layout it expects.
These checks need no process group; ``tests/multiproc/test_tp_plan_checks_multiproc.py``
shows the same plans under ``tp_size=2``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

import accel
from accel.errors import ConfigError
from accel.parallel.tp_plan import check_plan
from tests import mesh_models as mm

_NO_HF = importlib.util.find_spec("transformers") is None


def _pair(width: int, hidden: int) -> nn.Sequential:
    """Linear(width -> hidden), GELU, Linear(hidden -> width): an MLP's up and down."""
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def _refusal(model: nn.Module, plan: dict[str, Any], tp_size: int) -> str:
    with pytest.raises(ConfigError) as caught:
        check_plan(model, plan, tp_size)
    return str(caught.value)


def test_the_issues_plan_is_refused_naming_module_shape_style_and_tp_size() -> None:
    """Linear(6->5) colwise + Linear(5->6) rowwise on 2 ranks: torch accepts the split and
    the first forward fails with "a and b must have same reduction dim"."""
    said = _refusal(_pair(6, 5), {"0": "colwise", "2": "rowwise"}, 2)
    assert "'0'" in said and "Linear(in_features=6, out_features=5, bias=True)" in said
    assert "'colwise'" in said and "tp_size=2" in said and "out_features=5" in said
    assert "'2'" in said  # the rowwise neighbour it feeds is named
    assert "1 more planned module" in said  # the rowwise side is refused too


def test_rowwise_needs_in_features_divisible() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 4))
    said = _refusal(model, {"2": "rowwise"}, 2)
    assert "'2'" in said and "'rowwise'" in said and "in_features=5" in said
    assert "tp_size=2" in said and "Linear(in_features=5, out_features=4" in said
    check_plan(model, {"2": "rowwise"}, 5)  # 5 ranks share 5 features


def test_an_embedding_split_by_columns_needs_embedding_dim_divisible() -> None:
    model = nn.Sequential(nn.Embedding(8, 5), nn.Linear(5, 3))
    said = _refusal(model, {"0": "colwise"}, 2)
    assert "Embedding(8, 5)" in said and "embedding_dim=5" in said and "tp_size=2" in said


def test_an_embedding_split_by_rows_must_give_every_rank_rows() -> None:
    """The vocabulary rows are looked up on a full (replicated) input and summed: torch takes
    an uneven split (an odd vocabulary), but a rank left with no rows fails the lookup
    (``index_select(): self indexing axis dim should be positive``)."""
    model = nn.Sequential(nn.Embedding(5, 8), nn.Linear(8, 3))
    for style in ("embedding_rowwise", "rowwise"):
        said = _refusal(model, {"0": style}, 4)  # torch's pieces: 2, 2, 1, 0
        assert "Embedding(5, 8)" in said and "num_embeddings=5" in said
        assert f"{style!r}" in said and "tp_size=4" in said and "[2, 2, 1, 0]" in said
    check_plan(model, {"0": "embedding_rowwise"}, 2)  # 3 rows and 2 rows: both hold some


def test_a_gathered_column_split_takes_an_odd_vocabulary() -> None:
    """The LM head's output is gathered in full: an uneven split of the vocabulary is
    computed right by torch (a fine-tuned Llama with one added token: 32001 rows)."""
    head = nn.Sequential(nn.Linear(8, 65))
    check_plan(head, {"0": "colwise_gather_output"}, 2)
    check_plan(nn.Sequential(nn.Linear(65, 8)), {"0": "rowwise_split_input"}, 2)
    said = _refusal(nn.Sequential(nn.Linear(8, 3)), {"0": "colwise_gather_output"}, 4)
    assert "rank 3" in said and "[1, 1, 1, 0]" in said


@pytest.mark.parametrize(
    ("module", "style", "words"),
    [
        (nn.LayerNorm(8), "colwise", "LayerNorm((8,), eps=1e-05, elementwise_affine=True"),
        (nn.Conv2d(3, 8, 3), "colwise", "Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1))"),
        (nn.Conv2d(3, 8, 3), "rowwise", "'rowwise' splits only nn.Linear and nn.Embedding"),
        (nn.LayerNorm(8), "colwise_gather_output", "'colwise_gather_output' splits only"),
        (nn.Linear(8, 8), "sequence_parallel", "'sequence_parallel' runs only"),
        (nn.GELU(), "sequence_parallel", "GELU(approximate='none')"),
    ],
    ids=["layernorm-colwise", "conv2d-colwise", "conv2d-rowwise", "layernorm-gathered",
         "linear-sequence", "gelu-sequence"],
)
def test_a_style_that_does_not_fit_the_module_is_refused(
    module: nn.Module, style: str, words: str
) -> None:
    model = nn.Sequential(module)
    said = _refusal(model, {"0": style}, 2)
    assert words in said and "'0'" in said and f"{style!r}" in said and "tp_size=2" in said


def test_the_type_checks_hold_on_one_process_too() -> None:
    """Without a tp dim the plan is checked and the model left whole: a plan that would fail
    on a mesh fails where it is written (as a pattern naming no module does)."""
    with accel.distributed():
        for model, plan in ((nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), {"1": "colwise"}),
                            (nn.Sequential(nn.Conv2d(3, 4, 3)), {"0": "colwise"}),
                            (_pair(4, 8), {"0": "colwise_gather_output", "2": "rowwise"})):
            with pytest.raises(ConfigError, match="tp_size=1"):
                accel.prepare_model(model, tp_plan=plan)
        model = accel.prepare_model(_pair(6, 5), tp_plan={"0": "colwise", "2": "rowwise"})
        assert type(model[0].weight) is nn.Parameter  # 1 rank divides anything: left whole


def test_sequence_parallel_takes_norms_and_dropout() -> None:
    class RMSNorm(nn.Module):  # the python RMSNorm torch's SequenceParallel names
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    model = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8), nn.Dropout(0.1), RMSNorm())
    plan = {str(i): "sequence_parallel" for i in range(4)}
    assert {type(s) for s in check_plan(model, plan, 2).values()} == {SequenceParallel}


def test_colwise_to_rowwise_neighbours_must_agree_on_the_layout() -> None:
    """A gathered column split hands on the full activation, which a plain row split takes
    for its share (and the other way round): the forward fails on any mesh."""
    said = _refusal(_pair(4, 8), {"0": "colwise_gather_output", "2": "rowwise"}, 2)
    assert "'0'" in said and "'2'" in said and "'colwise_gather_output'" in said
    assert "'rowwise'" in said and "Linear(in_features=8, out_features=4" in said
    said = _refusal(_pair(4, 8), {"0": "colwise", "2": "rowwise_split_input"}, 2)
    assert "'colwise'" in said and "'rowwise_split_input'" in said
    check_plan(_pair(4, 8), {"0": "colwise_gather_output", "2": "rowwise_split_input"}, 2)
    check_plan(_pair(4, 8), {"0": "colwise", "2": "rowwise"}, 2)


def test_only_siblings_of_matching_sizes_are_taken_for_neighbours() -> None:
    """A fused projection (qkv: 3x the width) feeding a row split is no visible pair: the
    sizes differ, so nothing is assumed about the layout between them."""
    model = nn.Sequential(nn.Linear(8, 24), nn.Linear(8, 8))
    check_plan(model, {"0": "colwise", "1": "rowwise_split_input"}, 2)


def test_a_style_object_is_passed_through_unless_torch_would_refuse_it() -> None:
    class Custom(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return module

    custom = Custom()
    chosen = check_plan(nn.Sequential(nn.Conv2d(3, 8, 3)), {"0": custom}, 2)
    assert chosen == {"0": custom}
    local = ColwiseParallel(use_local_output=False)  # DTensor out: uneven shares work
    chosen = check_plan(_pair(6, 5), {"0": local, "2": RowwiseParallel()}, 2)
    assert chosen["0"] is local
    check_plan(nn.Sequential(nn.Linear(8, 8)), {"0": SequenceParallel()}, 2)
    said = _refusal(nn.Sequential(nn.LayerNorm(8)), {"0": ColwiseParallel()}, 2)
    assert "ColwiseParallel" in said and "LayerNorm((8,)" in said and "tp_size=2" in said


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_accels_own_test_plan_passes(tp_size: int) -> None:
    chosen = check_plan(mm.MLP(), mm.MLP_PLAN, tp_size)
    assert set(chosen) == {"blocks.0.up", "blocks.1.up", "blocks.0.down", "blocks.1.down"}


def _hf(family: str) -> nn.Module:
    import transformers

    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, f"{family}ForCausalLM")
    config = config_class(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, head_dim=8,
    )
    model: nn.Module = model_class(config)
    return model


@pytest.mark.skipif(_NO_HF, reason="transformers not installed")
@pytest.mark.parametrize(
    "family", ["Llama", "Qwen2", "Mistral", "GPTNeoX", "Gemma2", "Olmo2", "Starcoder2"]
)
def test_transformers_models_own_plans_pass(family: str) -> None:
    model = mm.llama() if family == "Llama" else _hf(family)
    for tp_size in (1, 2, 4):
        assert check_plan(model, "auto", tp_size)
    if family == "Llama":
        check_plan(mm.llama(tie=True), "auto", 2)


def test_a_bad_plan_is_refused_before_any_module_is_split() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 5))
    with pytest.raises(ConfigError):
        check_plan(model, {"0": "colwise", "1": "colwise", "2": "rowwise"}, 2)
    assert all(type(p) is nn.Parameter for p in model.parameters())
