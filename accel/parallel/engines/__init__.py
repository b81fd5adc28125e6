"""The engines (``strategy=``): one frozen unit per engine, chosen by name.

``accel.distributed(strategy=...)`` checks the name and holds it on the state;
:func:`~accel.parallel.engines.registry.engine_for` gives its unit, which ``prepare``,
``prepare_model``, ``backward``, the prepared optimizer, clipping, ``unwrap_model``,
``get_state_dict`` and ``save_state``/``load_state`` ask instead of branching on the name.
``base`` is the interface and the single-process engine (``"none"``); ``ddp``, ``fsdp`` and
``deepspeed`` are the others; ``registry`` says which unit serves each name and registers new
ones.
"""

__all__: list[str] = []  # the modules are imported on their own
