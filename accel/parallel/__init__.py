"""Parallelism: how a model and its gradients are split and synchronized across processes.

The modules, each imported on its own (this package defines no names):

- :mod:`accel.parallel.mesh`: N-D device meshes (data-parallel and tensor-parallel groups);
- :mod:`accel.parallel.fsdp`: FSDP2 sharding with ``fully_shard``;
- :mod:`accel.parallel.tensor_parallel`: ``tp_plan`` applied with ``parallelize_module``;
- :mod:`accel.parallel.local_sgd`: :class:`~accel.parallel.local_sgd.LocalSGD`
  (``accel.LocalSGD``);
- ``_ddp`` (DDP options and communication hooks), ``_ddp_teardown`` (DDP reducers released
  before their process group goes), ``_fsdp_params`` (the parameters FSDP replaced).

Example:
    >>> from accel.parallel.mesh import mesh_shape
    >>> mesh_shape(4, "fsdp", {"tp_size": 2})
    MeshShape(dp_replicate=1, dp_shard=2, tp=2)
"""
