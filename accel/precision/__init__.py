"""Mixed precision, one unit per mode: autocast, the prepared forward's casts, FSDP's policy
and master weights, and the GradScaler's life (loss scaling, unscaling, overflow agreement
over the mesh, skipped steps, its state for checkpoints).

``registry.precision_for(accel.state().mixed_precision)`` gives the mode's unit (``base``:
the interface and full precision, ``half``: bf16 and fp16, ``fp8``: torchao's float8 Linear
layers, bf16 around them); ``casting`` holds ``accel.autocast()`` and the forward wrapper,
``scaling`` the GradScaler's mechanics. Adding a mode is one module here plus one registry entry
(and its name and options in ``accel.core.settings``' table, see ``registry``).
"""

__all__: list[str] = []  # the modules are imported on their own
