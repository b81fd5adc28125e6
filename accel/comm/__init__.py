"""Communication between ranks: collectives, rank gating, debug-mode checks, agreement on
a failure, ``gather_for_metrics`` and ``join_uneven_inputs``. Every collective must be called
on every rank.
"""

__all__: list[str] = []  # the modules are imported on their own
