"""Sharded (DTensor) training state: each rank's own pieces (``pieces``), and reading them
back on any mesh (``reshard``).
"""
