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

One module per concept, each importing only the ones above it:

- :mod:`accel.parallel.context_parallel.plan`: the block's cp group (method, size, rank, mesh);
- :mod:`accel.parallel.context_parallel.autograd`: the group's all-to-all, sum and gather as
  autograd functions, each with its adjoint;
- :mod:`accel.parallel.context_parallel.attention`: all-to-all or ring attention
  (:func:`sequence_parallel_attention`);
- :mod:`accel.parallel.context_parallel.sharding`: a batch's sequences split over the cp ranks
  and gathered back (:func:`shard_sequence`, :func:`gather_sequence`);
- :mod:`accel.parallel.context_parallel.loss`: the loss of the whole batch
  (:func:`sequence_loss`);
- :mod:`accel.parallel.context_parallel.transformers`: a transformers model's attention and
  forward wired (:func:`apply_context_parallel`).

The package exports their public names (``__all__``):
``from accel.parallel.context_parallel import shard_sequence``.

Example:
    >>> with accel.distributed(cp_size=2):            # 2 processes split each sequence
    ...     model = accel.prepare_model(llama)        # a transformers model
    ...     loss = model(input_ids=ids, labels=ids).loss   # the whole batch's loss, every rank
"""

from __future__ import annotations

from accel.parallel.context_parallel.attention import sequence_parallel_attention
from accel.parallel.context_parallel.loss import sequence_loss
from accel.parallel.context_parallel.sharding import IGNORE_INDEX, gather_sequence, shard_sequence
from accel.parallel.context_parallel.transformers import ATTENTION_NAMES, apply_context_parallel

__all__ = [
    "ATTENTION_NAMES",
    "IGNORE_INDEX",
    "apply_context_parallel",
    "gather_sequence",
    "sequence_loss",
    "sequence_parallel_attention",
    "shard_sequence",
]
