"""Plans torch would split and then fail on are refused by ``prepare_model`` under ``tp_size=2``.

One spawned body (2 gloo ranks) prepares each model in turn: a refused plan raises the same
``ConfigError`` on both ranks before any collective (neither waits on the other, nothing is
split), and an accepted plan gives the one-process forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import accel
from accel.errors import ConfigError
from accel.testing import run_distributed
from tests import mesh_models as mm


def _case(which: str) -> tuple[nn.Module, dict[str, Any], torch.Tensor]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    x = torch.randn(2, 6)
    if which == "issue":  # Linear(6->5) colwise + Linear(5->6) rowwise
        return (nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 6)),
                {"0": "colwise", "2": "rowwise"}, x)
    if which == "rowwise-in":
        return (nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 6)), {"2": "rowwise"}, x)
    if which == "layernorm":
        return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8)), {"1": "colwise"}, x
    if which == "conv2d":
        return nn.Sequential(nn.Conv2d(3, 4, 3)), {"0": "colwise"}, torch.randn(1, 3, 5, 5)
    if which == "embedding-empty-rank":  # 1 row over 2 ranks: torch's pieces 1 and 0
        return (nn.Sequential(nn.Embedding(1, 8), nn.Linear(8, 2)), {"0": "embedding_rowwise"},
                torch.tensor([[0, 0]]))
    if which == "gathered-into-rowwise":
        return (nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)),
                {"0": "colwise_gather_output", "2": "rowwise"}, x)
    if which == "odd-vocabulary":  # uneven rows, gathered output: torch computes it right
        return (nn.Sequential(nn.Embedding(5, 8), nn.Linear(8, 5)),
                {"0": "embedding_rowwise", "1": "colwise_gather_output"},
                torch.tensor([[0, 1, 4, 3]]))
    if which == "style-objects":  # passed through: a DTensor output takes uneven shares
        return (nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 6)),
                {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()}, x)
    return mm.MLP(), mm.MLP_PLAN, torch.randn(2, 8)


CASES = ["issue", "rowwise-in", "layernorm", "conv2d", "embedding-empty-rank",
         "gathered-into-rowwise", "odd-vocabulary", "style-objects", "mlp"]


def _prepare_each() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for which in CASES:
        model, plan, x = _case(which)
        want = model(x).detach()
        try:
            prepared = accel.prepare_model(model, tp_plan=plan)
        except ConfigError as error:
            whole = not any(isinstance(p, DTensor) for p in model.parameters())
            out[which] = ("refused", str(error), whole)
            continue
        got = prepared(x)
        out[which] = ("same", bool(torch.allclose(got, want, atol=1e-5)), None)
    return out


def test_plans_that_cannot_split_are_refused_alike_on_every_rank() -> None:
    out = run_distributed(_prepare_each, world_size=2, timeout=240, tp_size=2)
    assert out[0] == out[1]  # the same verdict and words on both ranks
    got = out[0]
    refused = {which for which, (verdict, _, _) in got.items() if verdict == "refused"}
    assert refused == {"issue", "rowwise-in", "layernorm", "conv2d", "embedding-empty-rank",
                       "gathered-into-rowwise"}, got
    for which in refused:
        assert got[which][2], which  # nothing was split before the refusal
        assert "tp_size=2" in got[which][1], got[which][1]
    assert "out_features=5" in got["issue"][1] and "'0'" in got["issue"][1]
    assert "in_features=5" in got["rowwise-in"][1]
    assert "LayerNorm((8,)" in got["layernorm"][1] and "'colwise'" in got["layernorm"][1]
    assert "Conv2d(3, 4" in got["conv2d"][1]
    assert "num_embeddings=1" in got["embedding-empty-rank"][1]
    assert "'colwise_gather_output'" in got["gathered-into-rowwise"][1]
    for which in ("odd-vocabulary", "style-objects", "mlp"):
        assert got[which] == ("same", True, None), (which, got[which])
