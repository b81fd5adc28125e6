"""The training path: ``prepare`` / ``prepare_model``, ``accumulate`` / ``backward``, the
prepared optimizer (clipping, GradScaler steps) and scheduler, ``LocalSGD``.
"""

__all__: list[str] = []  # the modules are imported on their own
