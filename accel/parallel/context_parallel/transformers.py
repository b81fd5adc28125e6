"""A transformers model wired for the block's ``cp`` dim by ``prepare_model``
(:func:`apply_context_parallel`).

accel's attention is registered with transformers' ``AttentionInterface`` under a name of
:data:`ATTENTION_NAMES` and set as the model's ``config._attn_implementation``; its forward
becomes a :class:`SequenceShardedForward`, which takes the whole batch, runs the model on this
rank's piece and returns the whole batch's loss. Both are undone at the block's end.
transformers itself is imported only when a model is wired.

Example:
    >>> with accel.distributed(cp_size=2):
    ...     wired = apply_context_parallel(llama)           # True
    ...     loss = llama(input_ids=ids, labels=ids).loss    # the whole batch's, every cp rank
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

import torch
from torch import nn

from accel.errors import ArgumentTypeError, ConfigError
from accel.parallel.context_parallel.attention import _attention, _check_heads
from accel.parallel.context_parallel.loss import _loss
from accel.parallel.context_parallel.plan import _Plan, _plan
from accel.parallel.context_parallel.sharding import _agree, _gather, _shard

__all__ = ["ATTENTION_NAMES", "SequenceShardedForward", "apply_context_parallel"]

_LOG = logging.getLogger("accel")

ATTENTION_NAMES = {"alltoall": "accel_cp_alltoall", "ring": "accel_cp_ring"}
"""The names accel registers with transformers' ``AttentionInterface``, per ``cp_method``."""
_PLAN = "_accel_cp"  # the module __dict__ key of a prepared attention module's _Plan


def _transformers_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered with transformers' ``AttentionInterface`` (SDPA's contract)."""
    plan = module.__dict__.get(_PLAN) or _plan()
    if plan is None:  # not under context parallelism: transformers' own SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )
    if attention_mask is not None:
        raise ConfigError(
            "Context parallel attention got an attention mask; it takes none (the prepared "
            "forward refuses padding masks). Call the model without a 4-D mask under cp."
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = _attention(plan, query, key, value, is_causal=bool(causal), scale=scaling,
                     dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


class SequenceShardedForward:
    """A transformers model's forward under context parallelism (installed by
    :func:`apply_context_parallel` as the instance ``forward``).

    Takes the whole batch (the cp ranks first check they were given the same shapes: one
    small ``all_gather``), runs the model on this rank's piece (:func:`shard_sequence`) and
    returns its output with ``loss`` the whole batch's (:func:`sequence_loss`) when labels were
    given; ``logits`` (and ``last_hidden_state``) then stay this rank's piece, else they are
    gathered to the whole sequence (:func:`gather_sequence`).
    """

    def __init__(self, original: Any, plan: _Plan) -> None:
        self.original = original
        self.plan = plan
        self.parameters = list(inspect.signature(original).parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = dict(zip(self.parameters, args, strict=False))
        clash = set(named) & set(kwargs)
        if clash:
            raise ArgumentTypeError(
                f"forward() got multiple values for {sorted(clash)}: pass each argument once, "
                "by position or by name."
            )
        given = {**named, **kwargs}
        batch = _shard(given, self.plan, masked=_agree(given, self.plan))
        shift = batch.pop("shift_labels", None)
        count = batch.pop("num_items_in_batch", None)
        if shift is not None:
            batch["labels"] = None  # the loss of the pieces is computed here
        if "use_cache" in self.parameters:
            batch["use_cache"] = False
        out = self.original(**batch)
        logits = getattr(out, "logits", None)
        if shift is not None and isinstance(logits, torch.Tensor):
            loss = _loss(logits, shift, count, self.plan)
            return _replaced(out, loss=loss)
        found = {key: _gather(value, self.plan) for key in ("logits", "last_hidden_state")
                 if isinstance(value := getattr(out, key, None), torch.Tensor)}
        return _replaced(out, **found) if found else out

    def __repr__(self) -> str:
        return f"SequenceShardedForward({self.original!r}, method={self.plan.method!r})"


def _replaced(output: Any, **values: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        return type(output)(**{**fields, **values})
    if isinstance(output, dict):
        return type(output)({**output, **values})
    raise ConfigError(
        f"Context parallelism cannot set {sorted(values)} on the model's output of type "
        f"{type(output).__name__}; call the model with `return_dict=True`."
    )


def apply_context_parallel(model: nn.Module) -> bool:
    """Wire a transformers model for the block's ``cp`` dim; whether it was (in place).

    Registers accel's attention with transformers' ``AttentionInterface`` (no mask function:
    none is needed), sets ``config._attn_implementation`` to it, records the cp group on each
    attention module and wraps ``forward`` in :class:`SequenceShardedForward`. A model that
    is not a transformers model is left as it is (it takes :func:`shard_sequence` and
    :func:`sequence_parallel_attention` in its own code; said once). Called by
    ``prepare_model``; nothing happens without a ``cp`` dim > 1.

    Raises:
        ConfigError: a transformers model whose attention does not go through
            ``AttentionInterface``, or (alltoall) heads that ``cp_size`` does not divide.

    Example:
        >>> with accel.distributed(cp_size=2):
        ...     apply_context_parallel(llama)
        True
    """
    plan = _plan()
    if plan is None:
        return False
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        _LOG.info(
            "cp_size=%d: %s is not a transformers model, so prepare_model leaves its forward "
            "and attention alone: split batches with `shard_sequence`, attend with "
            "`sequence_parallel_attention` and reduce with `sequence_loss` "
            "(accel.parallel.context_parallel).", plan.size, type(model).__name__,
        )
        return False
    if not getattr(model, "_supports_attention_backend", False):
        raise ConfigError(
            f"cp_size={plan.size}: {type(model).__name__}'s attention does not go through "
            "transformers' AttentionInterface, so accel cannot split it over the sequence. "
            "Use a model whose attention does (Llama, Qwen2, GPT-2, Mistral, ...)."
        )
    if plan.method == "alltoall":
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int):
            kv = getattr(config, "num_key_value_heads", None)
            _check_heads(heads, kv if isinstance(kv, int) else heads, plan.size)
    from transformers import AttentionInterface

    name = ATTENTION_NAMES[plan.method]
    AttentionInterface.register(name, _transformers_attention)
    before = {id(config): config._attn_implementation}
    for module in model.modules():
        inner = getattr(module, "config", None)
        if inner is not None and hasattr(inner, "_attn_implementation"):
            before.setdefault(id(inner), inner._attn_implementation)
            inner._attn_implementation = name
        if type(module).__name__.endswith("Attention"):
            module.__dict__[_PLAN] = plan
    if not isinstance(model.__dict__.get("forward"), SequenceShardedForward):
        model.__dict__["forward"] = SequenceShardedForward(model.forward, plan)
    from accel.core.scope import at_block_exit

    at_block_exit(functools.partial(_unwire, weakref.ref(model), before))
    return True


def _unwire(ref: weakref.ref[nn.Module], before: dict[int, Any], failed: bool) -> None:
    """At the block's end: the model's attention and forward as they were before wiring."""
    model = ref()
    if model is None:
        return
    for module in model.modules():
        inner = getattr(module, "config", None)
        if inner is not None and id(inner) in before:
            inner._attn_implementation = before[id(inner)]
        module.__dict__.pop(_PLAN, None)
    forward = model.__dict__.get("forward")
    if isinstance(forward, SequenceShardedForward):
        original = forward.original
        if getattr(original, "__func__", None) is type(model).forward:
            del model.__dict__["forward"]  # the class's own forward again
        else:
            model.__dict__["forward"] = original
    elif forward is not None and isinstance(getattr(forward, "original", None),
                                            SequenceShardedForward):
        forward.original = forward.original.original  # inside the precision wrapper
