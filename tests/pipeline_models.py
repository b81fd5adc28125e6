"""Models and a training run shared by the pipeline-parallel tests.

``train`` runs inside ``accel.distributed(...)`` with or without a ``pp`` dim and returns what
the tests compare with one process: each step's loss and gradient norm, and the weights this
rank holds after the steps (by their global names; the test merges the stages).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import accel

BATCH = 8
SAMPLES = 32


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    """Input layer, ``depth`` blocks, head: the chain a pipeline splits."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)  # type: ignore[no-any-return]


LANGUAGE = ("llama", "llama-tied", "gpt2")


def gpt2() -> nn.Module:
    """A two-layer transformers GPT-2 built locally (its LM head tied to the embedding by
    default), without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def data(family: str = "stack") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if family in LANGUAGE:
        ids = torch.randint(0, 64, (SAMPLES, 6), generator=gen)
        return ids, ids
    x = torch.randn(SAMPLES, 4, generator=gen)
    return x, torch.randn(SAMPLES, 2, generator=gen)


def make(family: str = "stack") -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return gpt2()
    if family in LANGUAGE:
        from tests import mesh_models

        return mesh_models.llama(tie=family == "llama-tied")
    return Stack(depth=8 if family == "deep" else 4)


def loss_of(family: str) -> Any:
    if family in LANGUAGE:
        def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
            )
        return lm_loss
    return nn.functional.mse_loss


def train(family: str = "stack", steps: int = 3, *, start: int = 0, save: str | None = None,
          load: str | None = None, snapshot: int | None = None, **prepare: Any
          ) -> dict[str, Any]:
    """``steps`` AdamW steps through ``accel.pipeline_step`` with clipping and accumulation
    (from batch ``start``), optionally loading a checkpoint first and saving one after
    (``snapshot``: the full weights after that many steps are kept too, as ``"at"``)."""
    if prepare.pop("together", False):  # made before: accel.prepare moves it to the stage
        whole = make(family)
        model, optimizer = accel.prepare(whole, torch.optim.AdamW(whole.parameters(), lr=0.01))
    else:
        model = accel.prepare_model(make(family), **prepare)
        optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    if load is not None:
        accel.load_state(load, model=model, optimizer=optimizer)
    x, y = data(family)
    st = accel.state()
    per = BATCH // st.dp_world_size
    losses, norms = [], []
    at: dict[str, torch.Tensor] | None = None
    for step in range(start, start + steps):
        lo = step * BATCH + st.dp_rank * per
        with accel.accumulate(model):
            loss = accel.pipeline_step(model, x[lo:lo + per], y[lo:lo + per],
                                       loss_fn=loss_of(family))
            norm = accel.clip_grad_norm_(model.parameters(), 0.5)
            if accel.sync_gradients():
                norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accel.reduce(loss, reduction="mean")))
        if snapshot == step - start + 1:
            at = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    if save is not None:
        accel.save_state(save, model=model, optimizer=optimizer)
        accel.save_model(model, f"{save}_weights")  # full weights from every stage
    return {
        "at": at,
        "full": accel.get_state_dict(model),
        "losses": losses,
        "norms": norms,
        "weights": {k: v.detach().clone() for k, v in local_weights(model).items()},
        "pp": (st.pp_rank, st.pp_world_size),
        "tp": sorted(name for name, param in model.named_parameters()  # split over tp
                     if "tp" in (getattr(getattr(param, "device_mesh", None),
                                         "mesh_dim_names", None) or ())),
        "compiled": sorted(name for name, module in model.named_modules()
                           if getattr(module, "_compiled_call_impl", None) is not None),
    }


def local_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by global name, full (FSDP shards gathered within the stage)."""
    out = {}
    for name, param in model.named_parameters():
        full = getattr(param, "full_tensor", None)
        out[name] = (full() if full is not None else param).detach()
    return out


def merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every rank's weights in one dict (the stages hold disjoint names)."""
    out: dict[str, torch.Tensor] = {}
    for result in results:
        out.update(result["weights"])
    return out


def train_with(schedule: str, microbatches: int = 4) -> dict[str, Any]:
    """:func:`train` with ``pp_plan="auto"`` and the schedule named."""
    return train("stack", pp_plan="auto", pp_schedule=schedule, microbatches=microbatches)


def train_llama(schedule: str = "1F1B", family: str = "llama") -> dict[str, Any]:
    """:func:`train` on a tiny transformers Llama (or ``family``) split with ``pp_plan="auto"``."""
    return train(family, pp_plan="auto", pp_schedule=schedule, microbatches=4)


def refusals() -> dict[str, str]:
    """What a pipelined run refuses, each message by case (no step runs between them)."""
    from accel.errors import ConfigError

    said: dict[str, str] = {}
    cases: dict[str, Any] = {
        "no module": {"pp_plan": ["layers.9"]},
        "more stages than blocks": {"pp_plan": "auto", "pp_schedule": "Interleaved1F1B",
                                    "stages_per_rank": 3},
        "dualpipev microbatches": {"pp_schedule": "DualPipeV", "microbatches": 2},
        "1f1b microbatches": {"pp_schedule": "1F1B", "microbatches": 1},
        "unknown schedule": {"pp_schedule": "1f1b_typo"},
        "whole compile": {"compile": True},
    }
    for case, options in cases.items():
        try:
            accel.prepare_model(Stack(depth=2), **options)
        except ConfigError as error:
            said[case] = str(error)
    model = accel.prepare_model(Stack(), pp_plan=["layers.2"], microbatches=4)
    x, y = data()
    try:
        accel.pipeline_step(model, x[:6], y[:6], loss_fn=nn.functional.mse_loss)
    except ConfigError as error:
        said["batch"] = str(error)
    return said


def train_deep(schedule: str) -> dict[str, Any]:
    """:func:`train` on an 8-block stack (enough blocks for 4 ranks x 2 stages)."""
    return train("deep", pp_plan="auto", pp_schedule=schedule, microbatches=4)


def refused_with_fsdp() -> str:
    """The refusal of a zero-bubble schedule under FSDP (data parallel inside the stages)."""
    from accel.errors import ConfigError

    try:
        accel.prepare_model(Stack(), pp_plan="auto", pp_schedule="ZBVZeroBubble")
    except ConfigError as error:
        return str(error)
    return "not refused"


def chain(steps: int, start: int, save: str | None, load: str | None,
          schedule: str | None, family: str = "stack", snapshot: int | None = None
          ) -> dict[str, Any]:
    """:func:`train` from batch ``start``, loading and saving; pipelined when ``schedule``."""
    prepare: dict[str, Any] = {} if schedule is None else {
        "pp_plan": "auto", "pp_schedule": schedule, "microbatches": 4}
    return train(family, steps, start=start, save=save, load=load, snapshot=snapshot,
                 **prepare)


def train_checkpointed(schedule: str) -> dict[str, Any]:
    """:func:`train` with activation checkpointing on the stages' blocks."""
    return train("stack", pp_plan="auto", pp_schedule=schedule, microbatches=4,
                 activation_checkpointing=True)


def train_prepared_together() -> dict[str, Any]:
    """:func:`train` through ``accel.prepare(model, optimizer)`` (pp_plan "auto", 1F1B)."""
    return train("stack", together=True)


def refused_with_cp() -> dict[str, Any]:
    """Where a rank stands on a pp x cp mesh, and ``prepare_model``'s refusal of the pair."""
    from accel.errors import ConfigError

    st = accel.state()
    try:
        accel.prepare_model(Stack(), pp_plan="auto")
        said = "not refused"
    except ConfigError as error:
        said = str(error)
    return {"mesh": st.mesh_shape, "dims": st.mesh.mesh_dim_names, "said": said,
            "ranks": (st.pp_rank, st.dp_rank, st.cp_rank, st.tp_rank),
            "sizes": (st.pp_world_size, st.dp_world_size, st.cp_world_size)}


def compiled_llama_tp() -> dict[str, Any]:
    """:func:`train` on the tiny Llama split by its own plan over the ``tp`` dim, each block
    compiled (regional, ``aot_eager``: no C++ build), pipelined under a ``pp`` dim."""
    prepare: dict[str, Any] = {"tp_plan": "auto",
                               "compile": {"regional": True, "backend": "aot_eager"}}
    if accel.state().pp_world_size > 1:
        prepare.update(pp_plan="auto", pp_schedule="1F1B", microbatches=4)
    return train("llama", **prepare)


def fp8_stages() -> dict[str, Any]:
    """Two steps of a 16-wide stack under fp8: which layers each stage converted."""
    torch.manual_seed(0)
    model = accel.prepare_model(Stack(width=16), pp_plan="auto", microbatches=2)
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    x, y = data()
    losses = []
    for step in range(2):
        loss = accel.pipeline_step(model, x[step * 8:step * 8 + 8], y[step * 8:step * 8 + 8],
                                   loss_fn=nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"float8": sorted(name for name, m in model.named_modules()
                             if type(m).__name__ == "Float8Linear"), "losses": losses}


def embedding_name(family: str) -> str:
    """The token embedding's name in a language model of ``family`` (the LM head's tie)."""
    return "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"


def outputs_and_forward(schedule: str = "1F1B", family: str = "stack") -> dict[str, Any]:
    """Two training steps returning the last stage's outputs (gathered for metrics), then
    ``accel.pipeline_forward`` on a batch of another shape and ``pipeline_step`` under
    ``torch.no_grad()``: what every rank got."""
    model = accel.prepare_model(make(family), pp_plan="auto", pp_schedule=schedule,
                                microbatches=4)
    optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(family)
    st = accel.state()
    per = BATCH // st.dp_world_size
    gathered, losses = [], []
    for step in range(2):
        lo = step * BATCH + st.dp_rank * per
        loss, outputs = accel.pipeline_step(model, x[lo:lo + per], y[lo:lo + per],
                                            loss_fn=loss_of(family), return_outputs=True)
        gathered.append(accel.gather_for_metrics(outputs))
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    wide = x[16:28] if family not in LANGUAGE else x[16:28, :4]  # other shapes than training
    forward = accel.pipeline_forward(model, wide)
    whole = accel.pipeline_forward(model, wide[:1], microbatches=1)  # a batch of one
    with torch.no_grad():
        loss, outputs = accel.pipeline_step(model, x[:BATCH], y[:BATCH],
                                            loss_fn=loss_of(family), return_outputs=True)
    return {"gathered": gathered, "losses": losses, "forward": forward, "whole": whole,
            "eval": (float(loss), outputs)}


def train_llama_tp(steps: int = 3, start: int = 0, save: str | None = None,
                   load: str | None = None, snapshot: int | None = None,
                   family: str = "llama") -> dict[str, Any]:
    """:func:`train` on the tiny Llama (``family``: ``"llama-tied"``, its LM head tied to the
    embedding), pipelined (``pp_plan="auto"``, 1F1B) under a ``pp`` dim, each stage split by
    the model's own plan (``tp_plan="auto"``) under a ``tp`` dim (FSDP inside the stages under
    a data-parallel dim); on one process the same loop on the whole model."""
    prepare: dict[str, Any] = {}
    st = accel.state()
    if st.pp_world_size > 1:
        prepare.update(pp_plan="auto", pp_schedule="1F1B", microbatches=4)
    if st.tp_world_size > 1:
        prepare["tp_plan"] = "auto"
    return train(family, steps, start=start, save=save, load=load, snapshot=snapshot,
                 **prepare)


def train_compiled(schedule: str) -> dict[str, Any]:
    """:func:`train` with each stage's blocks compiled (``aot_eager``: no C++ build)."""
    return train("stack", pp_plan="auto", pp_schedule=schedule, microbatches=4,
                 compile={"regional": True, "backend": "aot_eager"})


STACK_TP = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
"""A tensor-parallel plan for :class:`Stack`'s blocks (each block's output whole)."""


def hop(steps: int, start: int, save: str | None, load: str | None) -> dict[str, Any]:
    """:func:`train` on the stack in whatever layout the mesh gives: pipelined (``"auto"``,
    1F1B) under a ``pp`` dim, :data:`STACK_TP` under a ``tp`` dim, FSDP under ``dp_shard``."""
    st = accel.state()
    prepare: dict[str, Any] = {}
    if st.pp_world_size > 1:
        prepare.update(pp_plan="auto", pp_schedule="1F1B", microbatches=4)
    if st.tp_world_size > 1:
        prepare["tp_plan"] = STACK_TP
    return train("stack", steps, start=start, save=save, load=load, **prepare)
