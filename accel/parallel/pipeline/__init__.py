"""Pipeline parallelism over the mesh's ``pp`` dim, on torch's engine
(``torch.distributed.pipelining``: ``PipelineStage`` and its schedules).

One module per concept, each imported on its own (this package defines no names):

- :mod:`accel.parallel.pipeline.split`: the plan (split points, an even split, ``"auto"``) and
  each stage built from the model by putting pass-throughs where other stages' modules were;
- :mod:`accel.parallel.pipeline.schedules`: torch's schedule names, which stages each rank
  holds, and the checks a schedule needs (microbatches, stages per rank, wrappings);
- :mod:`accel.parallel.pipeline.stages`: ``prepare_model``'s pipeline path: the stages of this
  rank, FSDP inside each, the ``PipelineStage`` objects and the schedule;
- :mod:`accel.parallel.pipeline.step`: ``accel.pipeline_step``, one training step for every
  rank;
- :mod:`accel.parallel.pipeline.agreement`: the ranks' batch shapes compared on every step
  (riding on the exchange of the step's loss), so that ranks fed different batches raise alike;
- :mod:`accel.parallel.pipeline.outputs`: the last stage's outputs broadcast to every rank
  (``pipeline_step(..., return_outputs=True)``) and ``accel.pipeline_forward`` (inference);
- :mod:`accel.parallel.pipeline.grads`: the gradient norm summed over the stages;
- :mod:`accel.parallel.pipeline.weights`: the full weights gathered from every stage;
- :mod:`accel.parallel.pipeline.ties`: parameters tied across stages (a copy on each, their
  gradients summed after the backward).
"""

__all__: list[str] = []  # the modules are imported on their own
