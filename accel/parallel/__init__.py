"""Parallelism: how a model and its gradients are split and synchronized across processes.

One module per engine, each imported on its own (this package defines no names):

- :mod:`accel.parallel.ddp`: DDP options and communication hooks; ``ddp_teardown``: DDP
  reducers released before their process group goes;
- :mod:`accel.parallel.fsdp`: FSDP2 sharding with ``fully_shard``; ``fsdp_params``: the
  parameters FSDP replaced (optimizer check, remap, clipping);
- :mod:`accel.parallel.tensor_parallel`: ``tp_plan`` applied with ``parallelize_module``;
- :mod:`accel.parallel.context_parallel`: sequences split over the ``cp`` mesh dim
  (all-to-all or ring attention, batch pieces, the whole batch's loss);
- :mod:`accel.parallel.blockwise`: activation checkpointing and regional compilation per
  block; ``blocks``: the blocks a transformers model declares;
- :mod:`accel.parallel.pipeline`: pipeline parallelism (its own package: the split, torch's
  schedules, the stages, ``pipeline_step``).

The mesh itself (its shape and the DeviceMesh) is :mod:`accel.core.mesh`.
"""

__all__: list[str] = []  # the modules are imported on their own
