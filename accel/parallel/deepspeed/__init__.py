"""DeepSpeed as an engine (``strategy="deepspeed"``): one package, one concept per module.

- :mod:`~accel.parallel.deepspeed.config`: the user's DeepSpeed config (a JSON path or a dict)
  with accel's shortcuts applied and every ``"auto"`` value filled from accel's settings;
- :mod:`~accel.parallel.deepspeed.engine`: ``deepspeed.initialize`` from ``accel.prepare`` and
  the training hooks (backward, the prepared optimizer, clipping, unwrapping);
- :mod:`~accel.parallel.deepspeed.weights`: full weights of a ZeRO-3 model;
- :mod:`~accel.parallel.deepspeed.checkpoint`: ``save_state``/``load_state`` in accel's own
  format, the engine's state given and taken as one plain process's model and optimizer;
- :mod:`~accel.parallel.deepspeed.zero_init`: ``accel.init_partitioned()``, a model built
  already partitioned under ZeRO-3 (``deepspeed.zero.Init`` with the block's config).

Not written yet: reading DeepSpeed's own checkpoint directories (``engine.save_checkpoint``).

Nothing here imports ``deepspeed`` at module level: it loads when a model is prepared.
"""

from __future__ import annotations

__all__: list[str] = []
