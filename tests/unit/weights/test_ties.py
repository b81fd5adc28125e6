"""Tied tensors in save_state checkpoints: stored once, loaded under whichever name fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import accel
from accel.errors import CheckpointError
from accel.weights import ties as _ties
from tests import tied_models as tm


def test_tie_map_names_each_alias_by_the_first_name() -> None:
    assert _ties.tie_map(tm.toy()) == {"head.weight": "embed.weight"}
    assert _ties.tie_map(tm.toy(head_first=True)) == {"embed.weight": "head.weight"}
    assert _ties.tie_map(tm.toy(tie=False)) == {}


def test_untie_fills_and_drops_names_through_both_sides_ties() -> None:
    value = torch.ones(2)
    saved = {"embed.weight": value, "other": torch.zeros(1)}
    untied = tm.toy(tie=False)
    out = _ties.untie(untied, saved, {"tied": {"head.weight": "embed.weight"}})
    assert out["head.weight"] is value and out["embed.weight"] is value
    # the target's first name is the head: the stored embedding name is dropped for it
    head_first = tm.toy(head_first=True)
    out = _ties.untie(head_first, saved, {})
    assert out["head.weight"] is value and "other" in out


def test_names_groups_chains() -> None:
    names = _ties.Names({"a": "b"}, {"c": "b", "d": "e"})
    assert names.group("a") == names.group("c") == names.group("b")
    assert names.group("d") == names.group("e") != names.group("a")
    assert names.group("z") == "z"


def _train(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    for i in range(2):
        tm.loss_of(model, tm.tokens(i)).backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_one_process_checkpoint_stores_the_tie_once_and_loads_anywhere(tmp_path: Path) -> None:
    model = tm.toy()
    opt = _train(model)
    accel.save_state(tmp_path, model=model, optimizer=opt)
    body = json.loads((tmp_path / "model.json").read_text())
    assert "head.weight" not in body["state"] and body["extra"]["tied"] == {
        "head.weight": "embed.weight"
    }
    opt_body = json.loads((tmp_path / "optimizer.json").read_text())
    assert opt_body["extra"]["param_names"][0][0] == "embed.weight"
    for kind in ({"head_first": True}, {"tie": False}, {}):
        target = tm.toy(seed=3, **kind)  # type: ignore[arg-type]
        target_opt = torch.optim.AdamW(target.parameters(), lr=0.02)
        accel.load_state(tmp_path, model=target, optimizer=target_opt)
        assert torch.equal(target.head.weight, model.embed.weight), kind
        assert torch.equal(target.embed.weight, model.embed.weight), kind
        for param in target.parameters():  # AdamW moments of the tied tensor, in each slot
            assert torch.equal(
                target_opt.state[param]["exp_avg"], opt.state[model.embed.weight]["exp_avg"]
            ) or param.shape != model.embed.weight.shape
        if kind == {"tie": False}:  # two slots, two tensors: stepping one leaves the other
            moments = [target_opt.state[p]["exp_avg"] for p in (target.embed.weight,
                                                                  target.head.weight)]
            assert moments[0] is not moments[1]


def test_checkpoint_holding_every_name_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tm.toy()
    opt = _train(model)
    monkeypatch.setattr(_ties, "tie_map", lambda module: {})  # as accel wrote before
    from accel.checkpoint import _saving

    monkeypatch.setattr(_saving, "split_ties", lambda module, sd: (dict(sd), {}))
    monkeypatch.setattr(_saving, "optimizer_names", lambda opt, objects: {})
    accel.save_state(tmp_path, model=model, optimizer=opt)
    monkeypatch.undo()
    assert "head.weight" in json.loads((tmp_path / "model.json").read_text())["state"]
    target = tm.toy(seed=3)
    accel.load_state(tmp_path, model=target, optimizer=torch.optim.AdamW(target.parameters()))
    assert torch.equal(target.head.weight, model.embed.weight)


def test_an_optimizer_over_other_parameters_is_still_refused(tmp_path: Path) -> None:
    model = tm.toy()
    opt = _train(model)
    accel.save_state(tmp_path, model=model, optimizer=opt)
    target = tm.toy(seed=3)
    partial = torch.optim.AdamW(list(target.blocks.parameters()), lr=0.02)
    with pytest.raises(CheckpointError, match="optimizer"):
        accel.load_state(tmp_path, model=target, optimizer=partial)
