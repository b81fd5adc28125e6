"""The names the guide's fragments take from their page's prose: a tiny classifier, its data,
loader, optimizer and scheduler, a small model with ``embed``/``layers``/``head`` for the
big-model pages, and the helpers the loops call (``train_step``, ``generate``...).

Every ``python``/``gpu``/``launch`` block of the pages starts from a fresh copy of
:func:`namespace` (tests/docs/blocks.py), so a block that defines its own names simply
replaces these.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


class DecoderLayer(nn.Module):
    """A residual block (kept whole by ``no_split_module_classes``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.fc(h))


class MyModel(nn.Module):
    """``embed``, ``layers.0`` to ``layers.2`` and ``head``: the module names the pages use."""

    def __init__(self, config: dict[str, int] | None = None) -> None:
        super().__init__()
        config = config or {"vocab": 32, "dim": 16, "layers": 3}
        self.embed = nn.Embedding(config["vocab"], config["dim"])
        self.layers = nn.ModuleList(DecoderLayer(config["dim"]) for _ in range(config["layers"]))
        self.head = nn.Linear(config["dim"], config["vocab"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# pages whose ``model`` has blocks (``embed``, ``layers.N``, ``head``; elsewhere: a classifier)
BLOCK_MODEL_PAGES = ("docs/big_models.md", "docs/big_models_dispatch.md",
                     "docs/activation_checkpointing.md")
# GPT-2's configuration (what docs/cli.md's ``gpt2/config.json`` holds)
GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
        "n_layer": 12, "n_head": 12, "architectures": ["GPT2LMHeadModel"]}


def write_files() -> None:
    """The files the pages read, in the current directory: ``critic`` (a plain torch state
    dict), ``checkpoints/my-model`` (safetensors weights) and ``gpt2/config.json``."""
    model = MyModel()
    torch.save(model.state_dict(), "critic")
    accel.save_model(model, "checkpoints/my-model")
    os.makedirs("gpt2", exist_ok=True)
    with open("gpt2/config.json", "w", encoding="utf-8") as f:
        json.dump(GPT2, f)


def evaluate(batch_size: int | None = None) -> None:
    """The reader's evaluation function (docs/state.md, docs/tracking.md)."""


def namespace(page: str = "") -> dict[str, Any]:
    """A fresh namespace for one block of ``page`` (a new model, optimizer, loader... each
    time)."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = (x.sum(1) > 0).long()
    dataset = TensorDataset(x, y)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4)
    loader = DataLoader(dataset, batch_size=8, shuffle=True)
    config = {"vocab": 32, "dim": 16, "layers": 3}
    ns: dict[str, Any] = {"__name__": "__main__"}

    def train_step(batch: Any) -> torch.Tensor:
        """One optimizer step of the namespace's current model and optimizer."""
        xb, yb = batch
        loss = F.cross_entropy(ns["model"](xb), yb)
        accel.backward(loss)
        ns["optimizer"].step()
        ns["optimizer"].zero_grad()
        return loss

    ns.update(
        accel=accel, torch=torch, nn=nn, F=F, DataLoader=DataLoader,
        TensorDataset=TensorDataset, os=os, signal=signal, contextlib=contextlib,
        dataclasses=dataclasses, json=json,
        x=x, y=y, dataset=dataset, data=dataset, batch=(x[:8], y[:8]),
        model=model, bare_model=nn.Linear(8, 2),
        optimizer=optimizer, opt=optimizer, scheduler=scheduler, sched=scheduler,
        loader=loader, train_loader=loader,
        eval_loader=DataLoader(TensorDataset(x[:20], y[:20]), batch_size=8),
        loss_fn=F.cross_entropy, train_step=train_step,
        objects={"model": model, "optimizer": optimizer, "scheduler": scheduler},
        total_steps=8, step=3, epoch=0, num_epochs=2, ckpt_dir="ckpt",
        args=argparse.Namespace(lr=0.1, epochs=2),
        prompts=["a", "b", "c"], generate=str.upper, load_or_build_cache=lambda: dataset,
        report=accel.on_main_process(lambda: "written"),
        MyModel=MyModel, DecoderLayer=DecoderLayer, config=config,
        input_ids=torch.randint(0, 32, (2, 5)), tokens=torch.randint(0, 32, (2, 5)),
        train=lambda: None, evaluate=evaluate,
    )
    if page in BLOCK_MODEL_PAGES:
        ns["model"] = MyModel(config)
    if page == "docs/tracking.md":  # `model(batch)`: a batch of inputs
        ns["batch"] = x[:8]
    return ns
