"""A DeepSpeed config's ``"optimizer"`` and ``"scheduler"`` sections against the loop's own
torch optimizer and scheduler.

Many DeepSpeed configs carry an ``"optimizer"`` section whose values are ``"auto"`` (the
templates Accelerate and transformers ship); Accelerate then wants a ``DummyOptim`` and
transformers fills them from its training arguments. In accel the loop's torch optimizer is
that source:

- a torch optimizer of the section's kind (DeepSpeed's ``Adam`` is AdamW unless
  ``adam_w_mode`` is false) whose hyper-parameters agree with every value the section writes
  (``"auto"`` agrees with anything) is the run's optimizer, and the section is dropped;
- a different kind, or a value the section writes that differs from the optimizer's, is a
  ``ConfigError`` naming both, never a silent winner;
- a ``"scheduler"`` section beside a torch scheduler passed to ``accel.prepare`` is a
  ``ConfigError`` (both would set the learning rate); alone, its ``warmup_max_lr`` /
  ``warmup_min_lr`` ``"auto"`` become the optimizer's lr and 0 (as transformers fills them)
  and DeepSpeed steps it in ``optimizer.step()``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import attrs

from accel.errors import ConfigError

__all__ = ["Client", "reconcile"]

_COMPARED = ("lr", "betas", "eps", "weight_decay")
_TORCH_KINDS = {"adamw": "adamw", "adagrad": "adagrad"}


@attrs.frozen(kw_only=True)
class Client:
    """What the loop passed to ``accel.prepare`` beside the model.

    Example:
        >>> Client.of(torch.optim.AdamW(model.parameters(), lr=1e-3), None).kind
        'adamw'
    """

    kind: str | None = None
    """The torch optimizer's class name, lower case (``None``: no optimizer passed)."""
    defaults: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    """Its constructor's hyper-parameters (``optimizer.defaults``)."""
    scheduler: bool = False
    """Whether a torch LR scheduler was passed too."""

    @classmethod
    def of(cls, optimizer: Any, scheduler: Any) -> Client:
        """The client facts of a torch optimizer (or ``None``) and scheduler (or ``None``)."""
        if optimizer is None:
            return cls(scheduler=scheduler is not None)
        return cls(kind=type(optimizer).__name__.lower(),
                   defaults=dict(getattr(optimizer, "defaults", {}) or {}),
                   scheduler=scheduler is not None)


def _same(a: object, b: object) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return a == b


def _section_kind(section: Mapping[str, Any]) -> str:
    name = str(section.get("type", "")).lower()
    params = section.get("params")
    params = params if isinstance(params, Mapping) else {}
    if name == "adam":
        return "adamw" if params.get("adam_w_mode", True) else "adam"
    return _TORCH_KINDS.get(name, name)


def _drop_optimizer(config: dict[str, Any], client: Client) -> None:
    section = config["optimizer"]
    if not isinstance(section, Mapping):
        raise ConfigError(f"The DeepSpeed config's \"optimizer\" must be a section, got "
                          f"{section!r}.")
    kind = _section_kind(section)
    if kind != client.kind:
        raise ConfigError(
            f"The DeepSpeed config's optimizer is {section.get('type')!r} and the loop passes "
            f"a torch {client.kind} to accel.prepare; keep one: remove the config's "
            "\"optimizer\" section (your optimizer is used), or pass no optimizer (DeepSpeed "
            "builds the config's)."
        )
    params = section.get("params")
    params = params if isinstance(params, Mapping) else {}
    differ = [
        f"{key}: config {params[key]!r}, optimizer {client.defaults[key]!r}"
        for key in _COMPARED
        if key in params and params[key] != "auto" and key in client.defaults
        and not _same(params[key], client.defaults[key])
    ]
    if differ:
        raise ConfigError(
            "The DeepSpeed config's \"optimizer\" section and the torch optimizer passed to "
            f"accel.prepare disagree ({'; '.join(differ)}). Write \"auto\" in the config (the "
            "optimizer's values are used) or make them equal."
        )
    del config["optimizer"]  # the loop's optimizer is the section's optimizer


def _fill_scheduler(config: dict[str, Any], lr: object) -> None:
    section = config["scheduler"]
    params = section.get("params") if isinstance(section, Mapping) else None
    if not isinstance(params, dict):
        return
    if params.get("warmup_max_lr") == "auto" and isinstance(lr, int | float):
        params["warmup_max_lr"] = float(lr)
    if params.get("warmup_min_lr") == "auto":
        params["warmup_min_lr"] = 0.0


def reconcile(config: Mapping[str, Any], client: Client) -> dict[str, Any]:
    """``config`` with its optimizer section settled against the loop's optimizer and its
    scheduler's learning rates filled (see the module's docstring).

    Raises:
        ConfigError: an optimizer of another kind, a value that differs, or a scheduler
            section beside a torch scheduler.

    Example:
        >>> cfg = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
        >>> reconcile(cfg, Client(kind="adamw", defaults={"lr": 1e-3}))
        {}
    """
    out = copy.deepcopy(dict(config))
    lr: object = client.defaults.get("lr")
    if "optimizer" in out and client.kind is not None:
        _drop_optimizer(out, client)
    elif isinstance(out.get("optimizer"), Mapping):
        params = out["optimizer"].get("params")
        lr = params.get("lr") if isinstance(params, Mapping) else None
    if "scheduler" in out:
        if client.scheduler:
            raise ConfigError(
                "The DeepSpeed config has a \"scheduler\" section and the loop passes a torch "
                "scheduler to accel.prepare; both would set the learning rate. Keep one: "
                "remove the section, or do not pass the scheduler (DeepSpeed steps the "
                "config's in optimizer.step())."
            )
        _fill_scheduler(out, lr)
    return out
