"""Models that declare their blocks (transformers' _no_split_modules) get them by default."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
from torch import nn

import accel
from accel.parallel.blocks import declared_blocks
from accel.parallel.fsdp import default_shard_modules, describe_blocks, shard_targets


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Declared(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Layer", "NotInTheModel"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.big = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 64))  # the largest container


def test_declared_blocks_reads_the_class_attribute_of_every_submodule() -> None:
    assert declared_blocks(Declared()) == ["Layer"]
    assert declared_blocks(nn.Sequential(Declared())) == ["Layer"]  # through a wrapper
    assert declared_blocks(nn.Sequential(nn.Linear(2, 2))) == []


def test_fsdp_default_shards_the_declared_blocks_else_the_largest_container() -> None:
    model = Declared()
    assert default_shard_modules(model) == list(model.layers)
    plain = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    assert default_shard_modules(plain) == list(plain)
    line = describe_blocks(model, shard_targets(model, None), chosen_by_user=False)
    assert line == "FSDP shards 3 blocks (3 x Layer), then the root: the model's _no_split_modules."


def test_device_maps_keep_declared_blocks_whole() -> None:
    model = Declared()
    del model.big
    budget = {"cpu": 360}  # the embedding, the reserve and one block and a half
    declared = accel.infer_auto_device_map(model, max_memory=budget)
    split = accel.infer_auto_device_map(model, max_memory=budget, no_split_module_classes=[])
    assert not any(name.startswith("layers.1.") for name in declared), declared
    assert any(name.startswith("layers.1.") for name in split), split


transformers = pytest.importorskip("transformers")


def test_transformers_models_declare_their_blocks() -> None:
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=2, n_head=2)
    )
    assert declared_blocks(gpt2) == ["GPT2Block"]
    assert [type(m).__name__ for m in default_shard_modules(gpt2)] == ["GPT2Block"] * 2


def _shard_gpt2() -> list[str]:
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=2, n_head=2)
    )
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("accel.parallel.fsdp")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    accel.prepare_model(gpt2, strategy="fsdp")
    return [r for r in records if r.startswith("FSDP shards")]


@pytest.mark.preload("transformers", "transformers.models.gpt2.modeling_gpt2")  # workers
def test_fsdp_says_which_blocks_it_shards() -> None:
    from accel.testing import run_distributed

    said = run_distributed(_shard_gpt2, world_size=2, timeout=120)
    assert said[0] == [
        "FSDP shards 2 blocks (2 x GPT2Block), then the root: the model's _no_split_modules."
    ]
    assert said[1] == []
