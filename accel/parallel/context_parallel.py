"""Context parallelism: each sequence split over the ``cp`` ranks of the mesh.

``accel.distributed(cp_size=C)`` gives the mesh a ``cp`` dim: its ``C`` ranks see the same
batches (prepared loaders shard by the data-parallel rank only) and each works on ``1/C`` of
every sequence, so activations, the memory long contexts need, are split ``C`` ways. Weights are
not: they are replicated, or FSDP-sharded over ``dp_shard`` x ``cp`` (``accel.core.mesh.dp_mesh``).
Attention is the one layer that mixes positions; ``cp_method`` says how it sees the whole
sequence:

- ``"alltoall"`` (Ulysses): queries, keys and values sharded by sequence ``(B, H, S/C, D)`` are
  exchanged with one all-to-all into ``(B, H/C, S, D)`` (every rank gets the whole sequence for
  ``H/C`` heads), attention runs as plain SDPA (causal or not), and one more all-to-all gives
  back the sequence shard of every head. Exact, any device and backend (gloo included); the
  heads (and key/value heads) must divide by ``C``.
- ``"ring"``: torch's ring attention (``torch.distributed.tensor.experimental``), which passes
  key/value blocks around the group; CUDA attention kernels only. Causal sequences are split
  head-and-tail (rank ``r`` holds chunks ``r`` and ``2C-1-r`` of ``2C``) to balance the work.

A transformers model (attention through ``AttentionInterface``) is handled by
``prepare_model``: :func:`apply_context_parallel` switches its ``config._attn_implementation``
to accel's function and wraps its forward, which takes the WHOLE batch (as on one process),
keeps this rank's piece of ``input_ids``/``position_ids`` (the global positions, for RoPE) and of
the labels shifted BEFORE the split (so the last token of a piece keeps its target in the next
piece), and returns the loss of the whole batch on every cp rank (summed over the pieces, each
token once). Your own attention modules use :func:`sequence_parallel_attention`, with
:func:`shard_sequence`, :func:`sequence_loss` and :func:`gather_sequence` around them.

Example:
    >>> with accel.distributed(cp_size=2):            # 2 processes split each sequence
    ...     model = accel.prepare_model(llama)        # a transformers model
    ...     loss = model(input_ids=ids, labels=ids).loss   # the whole batch's loss, every rank
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from accel.core.state import state
from accel.errors import ArgumentTypeError, ConfigError

__all__ = [
    "ATTENTION_NAMES",
    "IGNORE_INDEX",
    "apply_context_parallel",
    "gather_sequence",
    "sequence_loss",
    "sequence_parallel_attention",
    "shard_sequence",
]

_LOG = logging.getLogger("accel")

IGNORE_INDEX = -100
"""The label of a token without target (transformers' and torch's ``ignore_index``)."""
ATTENTION_NAMES = {"alltoall": "accel_cp_alltoall", "ring": "accel_cp_ring"}
"""The names accel registers with transformers' ``AttentionInterface``, per ``cp_method``."""
_SHARDED_KEYS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "labels",
                 "shift_labels")
_PLAN = "_accel_cp"  # the module __dict__ key of a prepared attention module's _Plan


@attrs.frozen
class _Plan:
    """How one context-parallel group splits sequences: its method, size, rank and mesh."""

    method: str
    size: int
    rank: int
    mesh: Any = attrs.field(eq=False, repr=False)  # the cp DeviceMesh

    @property
    def balanced(self) -> bool:
        """Whether shards are head-and-tail (ring: causal work balanced) or contiguous."""
        return self.method == "ring"

    def group(self) -> Any:
        return self.mesh.get_group()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Plan:
        return self  # immutable; a copied model keeps its group


def _plan() -> _Plan | None:
    """The block's plan, or ``None`` without a ``cp`` dim > 1."""
    st = state()
    if st.cp_world_size == 1 or st.mesh is None:
        return None
    return _Plan(st.cp_method or "alltoall", st.cp_world_size, st.cp_rank, st.mesh["cp"])


# --- collectives with their adjoints (every rank of the cp group calls them, in order) ---


def _exchange(x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
    """All-to-all between ``(B, H, S/C, D)`` (sequence-sharded) and ``(B, H/C, S, D)``."""
    c = dist.get_world_size(group)
    if to_heads:
        b, h, s, d = x.shape
        send = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # [j]: rank j's piece, my heads
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)
    b, h, length, d = x.shape
    s = length // c
    send = x.reshape(b, h, c, s, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [j]: rank j's heads, my piece
    return received.transpose(0, 1).reshape(b, c * h, s, d)


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` forward; the opposite exchange backward (its adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _exchange(x.contiguous(), group, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _exchange(grad.contiguous(), ctx.group, not ctx.to_heads), None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; all-reduce of the gradients backward (its adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _Gather(torch.autograd.Function):
    """Every rank's piece concatenated on ``dim`` in rank order; backward: the sum of every
    rank's gradient for this rank's piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.dim, ctx.piece, ctx.rank = group, dim, x.shape[dim], rank
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.narrow(ctx.dim, ctx.rank * ctx.piece, ctx.piece), None, None


def _apply(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    out: torch.Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
    return out


# --- attention ---


def _check_heads(heads: int, kv_heads: int, size: int) -> None:
    if heads % size or kv_heads % size:
        raise ConfigError(
            f"cp_method='alltoall' splits attention heads over cp_size={size}, but the model "
            f"has {heads} attention heads and {kv_heads} key/value heads, which {size} does not "
            "both divide. Choose a cp_size that divides both, or `cp_method='ring'` (CUDA)."
        )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool,
          scale: float | None, dropout_p: float) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p
    )


def _ring(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool,
          scale: float | None, dropout_p: float) -> torch.Tensor:
    """torch's ring attention over the cp mesh (CUDA kernels; not testable on CPU)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import _attention as ring

    ring._enable_context_parallel_dispatcher()  # SDPA on DTensors sharded by sequence: ring
    ring._cp_options.enable_load_balance = True  # shard_sequence splits head-and-tail
    mesh = plan.mesh
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    q, k, v = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False)
               for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p
    )
    return out.to_local()  # type: ignore[no-any-return,attr-defined]


def _attention(plan: _Plan | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               is_causal: bool, scale: float | None, dropout_p: float) -> torch.Tensor:
    if plan is None:
        return _sdpa(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    if plan.method == "ring":
        return _ring(plan, q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    _check_heads(q.shape[1], k.shape[1], plan.size)
    group = plan.group()
    q, k, v = (_apply(_AllToAll, t, group, True) for t in (q, k, v))
    out = _sdpa(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    return _apply(_AllToAll, out, group, False)


def sequence_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over the whole sequence for inputs holding this rank's piece of it.

    Takes and returns ``(batch, heads, local_sequence, head_dim)`` like
    :func:`torch.nn.functional.scaled_dot_product_attention` (key/value may have fewer heads,
    grouped-query attention), the pieces being what :func:`shard_sequence` gave this rank.
    Under ``cp_method="alltoall"`` heads are exchanged with two all-to-alls around SDPA; under
    ``"ring"`` torch's ring attention runs. Without a ``cp`` dim > 1 it is plain SDPA.
    Differentiable. Every rank of the cp group must call it, in the same order.

    Raises:
        ConfigError: (alltoall) heads or key/value heads that ``cp_size`` does not divide.

    Example:
        >>> class Attention(nn.Module):
        ...     def forward(self, x):                          # x: (B, S/C, E), this rank's piece
        ...         q, k, v = (p(x).unflatten(-1, (4, -1)).transpose(1, 2)
        ...                    for p in (self.q, self.k, self.v))
        ...         out = sequence_parallel_attention(q, k, v, is_causal=True)
        ...         return self.o(out.transpose(1, 2).flatten(2))
    """
    return _attention(_plan(), query, key, value, is_causal=is_causal, scale=scale,
                      dropout_p=dropout_p)


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


# --- batches, losses and outputs ---


def _positions(length: int, plan: _Plan, device: torch.device) -> torch.Tensor:
    """The global positions this rank holds (contiguous, or head-and-tail for ring)."""
    if plan.balanced:
        chunk = length // (2 * plan.size)
        head = torch.arange(plan.rank * chunk, (plan.rank + 1) * chunk, device=device)
        tail_start = (2 * plan.size - 1 - plan.rank) * chunk
        return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])
    piece = length // plan.size
    return torch.arange(plan.rank * piece, (plan.rank + 1) * piece, device=device)


def _piece(tensor: torch.Tensor, plan: _Plan) -> torch.Tensor:
    index = _positions(tensor.shape[1], plan, tensor.device)
    if not plan.balanced:
        return tensor.narrow(1, int(index[0]), index.numel())
    return tensor.index_select(1, index)


def _check_length(length: int, plan: _Plan) -> None:
    parts = 2 * plan.size if plan.balanced else plan.size
    if length % parts:
        how = (f"2 x cp_size = {parts} (ring attention splits each sequence into head and tail "
               "chunks)" if plan.balanced else f"cp_size={parts}")
        raise ConfigError(
            f"Context parallelism splits each sequence over the cp ranks, but the sequence "
            f"length {length} does not divide by {how}. Pad the batch to a multiple of {parts} "
            f"(labels {IGNORE_INDEX} on the padding, e.g. `pad_to_multiple_of={parts}` in "
            "transformers' data collators)."
        )


def shard_sequence(batch: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's piece of a whole batch, split on the sequence dim (dim 1) over the cp group.

    ``input_ids``/``inputs_embeds``, ``token_type_ids`` and ``position_ids`` (made when absent:
    the GLOBAL positions ``0..S-1``, for RoPE and learned positions) are split alike. ``labels``
    are shifted BEFORE the split into ``shift_labels`` (the target of token ``t`` is label
    ``t+1``; the last is ``-100``), so no target is lost at a piece's border. An
    ``attention_mask`` of ones is
    dropped; one that masks tokens is refused. Other keys pass through. Without a ``cp`` dim > 1
    it returns the batch with ``shift_labels`` added. No communication.

    Raises:
        ConfigError: a sequence length that the cp size does not divide (2 x cp size for
            ring), or an attention mask with zeros.

    Example:
        >>> piece = shard_sequence({"input_ids": ids, "labels": ids})   # ids: (B, S)
        >>> piece["input_ids"].shape, sorted(piece)      # on each of 2 cp ranks
        (torch.Size([B, S/2]), ['input_ids', 'labels', 'position_ids', 'shift_labels'])
    """
    return _shard(batch, _plan())


def _shard(batch: Mapping[str, Any], plan: _Plan | None) -> dict[str, Any]:
    out = dict(batch)
    first = out.get("input_ids")
    if first is None:
        first = out.get("inputs_embeds")
    if not isinstance(first, torch.Tensor) or first.ndim < 2:
        raise ConfigError(
            "shard_sequence needs `input_ids` (batch, sequence) or `inputs_embeds` in the "
            f"batch; got keys {sorted(out)}."
        )
    length = first.shape[1]
    mask = out.pop("attention_mask", None)
    if isinstance(mask, torch.Tensor) and plan is not None and not bool(mask.all()):
        raise ConfigError(
            "Context parallelism takes no padding mask: the batch's attention_mask masks "
            "tokens. Pack sequences without padding, or pad at the end with labels -100 and "
            "drop the attention_mask (a causal model never attends to later tokens)."
        )
    if mask is not None and plan is None:
        out["attention_mask"] = mask
    labels = out.get("labels")
    if out.get("shift_labels") is None and isinstance(labels, torch.Tensor) and labels.ndim > 1:
        out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if plan is None:
        return out
    _check_length(length, plan)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(length, device=first.device).expand(
            first.shape[0], -1)
    for key in _SHARDED_KEYS:
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.ndim > 1 and value.shape[1] == length:
            out[key] = _piece(value, plan)
    return out


def sequence_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The next-token cross-entropy of the whole global batch, from this rank's pieces.

    Sums this rank's token losses (``shift_labels`` from :func:`shard_sequence`; ``-100`` is
    skipped; fp32), divides by the number of targets, and sums over the cp group, so every cp
    rank returns the same value. The count is, unless ``num_items_in_batch`` gives it, the
    targets of the GLOBAL batch divided by the data-parallel size (one all-reduce over every
    rank): then the mean of the returned losses over the ranks (``accel.reduce(loss,
    "mean")``) is the global batch's mean over its targets, each counted once, and the
    gradients DDP/FSDP average are one process's, even where ranks hold different numbers of
    targets (``-100`` labels, the last token of each sequence). Every rank must call it.

    Example:
        >>> piece = shard_sequence(batch)
        >>> logits = model(piece["input_ids"], piece["position_ids"])   # (B, S/C, vocab)
        >>> loss = sequence_loss(logits, piece["shift_labels"])
        >>> accel.backward(loss)
    """
    return _loss(logits, shift_labels, num_items_in_batch, _plan())


def _loss(logits: torch.Tensor, shift_labels: torch.Tensor,
          num_items_in_batch: int | torch.Tensor | None, plan: _Plan | None) -> torch.Tensor:
    total = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    count: int | torch.Tensor
    if num_items_in_batch is not None:
        count = num_items_in_batch
    else:  # the global batch's targets over the data-parallel ranks (see sequence_loss)
        count = (shift_labels != IGNORE_INDEX).sum().to(total.device, torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
            count = count * (1 if plan is None else plan.size) / dist.get_world_size()
    if isinstance(count, torch.Tensor):
        count = count.to(total.device, total.dtype)
    part = total / count
    if plan is None:
        return part
    return _apply(_SumOverGroup, part, plan.group())


def gather_sequence(tensor: torch.Tensor) -> torch.Tensor:
    """The whole sequence (dim 1) from every cp rank's piece, in order; differentiable.

    The inverse of :func:`shard_sequence`'s split (head-and-tail pieces are put back in
    place). Without a ``cp`` dim > 1 it returns ``tensor``. Every rank of the cp group must
    call it.

    Example:
        >>> logits = gather_sequence(model(**shard_sequence(batch)).logits)  # (B, S, vocab)
    """
    plan = _plan()
    return tensor if plan is None else _gather(tensor, plan)


def _gather(tensor: torch.Tensor, plan: _Plan) -> torch.Tensor:
    whole = _apply(_Gather, tensor, plan.group(), 1)
    if not plan.balanced:
        return whole
    length = tensor.shape[1] * plan.size
    order = torch.cat([_positions(length, attrs.evolve(plan, rank=r), tensor.device)
                       for r in range(plan.size)])
    return whole.index_select(1, torch.argsort(order))


# --- transformers models, wired by prepare_model ---


class SequenceShardedForward:
    """A transformers model's forward under context parallelism (installed by
    :func:`apply_context_parallel` as the instance ``forward``).

    Takes the whole batch, runs the model on this rank's piece (:func:`shard_sequence`) and
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
        batch = _shard({**named, **kwargs}, self.plan)
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
