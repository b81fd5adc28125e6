"""Sharded (DTensor) training state: each rank's own pieces (``pieces``), and reading them
back on any mesh (``reshard``).
"""

__all__: list[str] = []  # the modules are imported on their own
