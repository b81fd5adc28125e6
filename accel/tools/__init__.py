"""The toolbox around training, behind the ``accel`` subcommands that are not launching.

* :mod:`accel.tools.estimate` — ``accel estimate-memory`` / :func:`accel.estimate_memory`: what
  a model needs per process to train and to run, from a transformers config or any module,
  built on the meta device.
* :mod:`accel.tools.model_source` — the model an estimate is about: a config file, a directory
  holding one, a config object, a module or ``module:callable``.
* :mod:`accel.tools.merge` — ``accel merge-weights``: a ``save_state`` checkpoint (FSDP-sharded
  at any world size, DDP, one process) or an Accelerate ``save_state`` directory to the
  weights layout ``save_model`` writes, one tensor at a time.
* :mod:`accel.tools.checkpoint_source` — one model's tensors in a checkpoint, read one at a
  time (FSDP pieces assembled), for ``merge-weights``.
* :mod:`accel.tools.checkpoint_report` — ``accel checkpoint inspect`` / ``verify``.
* :mod:`accel.tools.config_import` — ``accel config import``: an Accelerate YAML config to
  accel's TOML config file.
* :mod:`accel.tools.commands` — their argument parsers and command functions.

Nothing here is imported by ``import accel``; each module loads on first use.
"""
