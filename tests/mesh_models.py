"""Models, data and a training run shared by the N-D mesh tests (tensor parallel, HSDP).

``train`` runs inside ``accel.distributed(...)`` on any mesh and returns what the tests compare
with one process: the full weights after the steps, each step's gradient norm and loss, and
the predictions gathered with ``gather_for_metrics``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel

MLP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
SAMPLES = 24
BATCH = 8  # the global batch: split between the data-parallel ranks


class Block(nn.Module):
    """An MLP block: up, GELU, down (the shape tensor parallelism splits)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class MLP(nn.Module):
    """Input layer, two blocks, head: the layers outside the blocks stay whole under TP."""

    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def llama(tie: bool = False) -> nn.Module:
    """A two-layer Llama (GQA: 8 heads, 4 key/value heads) built locally."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def make(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "mlp":
        return MLP()
    return llama(tie=family == "llama-tied")


def _data(family: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if family == "mlp":
        return TensorDataset(torch.randn(SAMPLES, 8, generator=g),
                             torch.randn(SAMPLES, 4, generator=g))
    ids = torch.randint(0, 64, (SAMPLES, 12), generator=g)
    return TensorDataset(ids, ids)


def _loss(family: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if family == "mlp":
        return nn.functional.mse_loss(model(x), y)
    return model(input_ids=x, labels=y).loss  # type: ignore[no-any-return]


def _predict(family: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if family == "mlp" else model(input_ids=x).logits[:, -1]
    return out.detach()


def train(family: str, steps: int = 3, plan: Any = None, save: str | None = None,
          load: str | None = None, foreach: bool | None = None,
          **prepare_options: Any) -> dict[str, Any]:
    """Train ``steps`` steps on the block's mesh; optionally load before / save after.

    Every step runs inside ``accel.accumulate`` (a no-op without gradient accumulation);
    gradient norms are recorded on sync steps only.
    """
    model = make(family)
    tp_plan = plan if plan is not None else (MLP_PLAN if family == "mlp" else "auto")
    model = accel.prepare_model(model, tp_plan=tp_plan, **prepare_options)
    lr = 0.01 if family == "mlp" else 0.001
    optimizer = accel.prepare_optimizer(
        torch.optim.AdamW(model.parameters(), lr=lr, foreach=foreach)
    )
    if load is not None:
        accel.load_state(load, model=model, optimizer=optimizer)
    loader = accel.prepare_data_loader(
        DataLoader(_data(family), batch_size=BATCH), split_batches=True
    )
    norms, losses = [], []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        with accel.accumulate(model):
            loss = _loss(family, model, x, y)
            accel.backward(loss)
            norm = accel.clip_grad_norm_(model.parameters(), 0.5)
            if accel.sync_gradients():
                norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accel.reduce(loss.detach(), reduction="mean")))
    if save is not None:
        accel.save_state(save, model=model, optimizer=optimizer)
        accel.save_model(model, f"{save}_weights")  # full weights, gathered
    seen = []
    eval_loader = accel.prepare_data_loader(DataLoader(_data(family), batch_size=5))
    with torch.no_grad():
        for x, _ in eval_loader:
            seen.append(accel.gather_for_metrics(_predict(family, model, x)))
    weights = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    st = accel.state()
    return {
        "weights": weights if st.is_main_process else None,
        "norms": norms,
        "losses": losses,
        "predictions": torch.cat(seen),
        "mesh": st.mesh_shape,
        "dp": (st.dp_rank, st.dp_world_size),
        "tp": (st.tp_rank, st.tp_world_size),
    }


def chain(family: str, steps: int, save: str, load: str | None) -> dict[str, Any]:
    """:func:`train` resuming from ``load`` (when given) and saving to ``save``."""
    return train(family, steps, None, save, load)


def train_checkpointed(family: str, steps: int) -> dict[str, Any]:
    """:func:`train` with activation checkpointing on the model's blocks."""
    return train(family, steps, activation_checkpointing=True)


def overflow_on_one_rank(bad_rank: int) -> dict[str, Any]:
    """One fp16 step where only ``bad_rank``'s local gradient piece holds an inf."""
    model = accel.prepare_model(make("mlp"), tp_plan=MLP_PLAN)
    optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = (t[:BATCH] for t in _data("mlp").tensors)
    accel.backward(_loss("mlp", model, x, y))
    if accel.state().rank == bad_rank:
        grad = model.inp.weight.grad  # a layer left whole: FSDP-sharded over dp_shard only
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = float("inf")
    before = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    optimizer.step()
    after = accel.get_state_dict(model)
    return {"skipped": accel.optimizer_step_was_skipped(optimizer),
            "changed": any(not torch.equal(before[k], after[k]) for k in before)}


def train_compiled(family: str, steps: int) -> dict[str, Any]:
    """:func:`train` with each block compiled (``compile="regional"``, eager backend)."""
    return train(family, steps, compile={"regional": True, "backend": "eager"})


def train_foreach(family: str, steps: int) -> dict[str, Any]:
    """:func:`train` with a ``foreach`` AdamW (one kernel over all parameters, CUDA's default)."""
    return train(family, steps, foreach=True)


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """An iterable dataset: prepared loaders dispatch it (global rank 0 reads, all slice)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.arange(11, dtype=torch.float32).unsqueeze(1))


def loader_batches(dispatch: bool) -> dict[str, Any]:
    """The batches this rank's prepared loader yields and what gather_for_metrics returns."""
    dataset: Any = Stream() if dispatch else TensorDataset(torch.arange(11.0).unsqueeze(1))
    loader = accel.prepare_data_loader(DataLoader(dataset, batch_size=2))
    mine, gathered = [], []
    for batch in loader:
        x = batch if dispatch else batch[0]
        mine.append(x.flatten().tolist())
        gathered.append(accel.gather_for_metrics(x))
    return {"mine": mine, "all": torch.cat(gathered).flatten().tolist()}


def prepare_all_at_once(family: str, steps: int) -> dict[str, Any]:
    """``accel.prepare(model, optimizer, loader)`` with the optimizer made before (no tp_plan:
    a transformers model is split by its own plan) and the same loop as :func:`train`."""
    model = make(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)
    per_rank = BATCH // accel.state().dp_world_size  # the same global batch on any mesh
    loader = DataLoader(_data(family), batch_size=per_rank)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = _loss(family, model, x, y)
        accel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accel.reduce(loss.detach(), reduction="mean")))
    split = any(hasattr(p, "placements") for p in model.parameters())
    return {"losses": losses, "weights": accel.get_state_dict(model), "split": split}


def without_plan() -> dict[str, Any]:
    """An MLP prepared under the block's mesh with no tp_plan (it carries none)."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("accel").addHandler(handler)
    try:
        model = accel.prepare_model(make("mlp"))
    finally:
        logging.getLogger("accel").removeHandler(handler)
    split = any(hasattr(p, "placements") and "Shard" in str(p.placements)
                and p.device_mesh.mesh_dim_names[-1] == "tp" for p in model.parameters())
    return {"split": split, "said": [r for r in records if "has no tp_plan" in r]}
