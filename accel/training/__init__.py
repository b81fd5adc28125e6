"""The training path: ``prepare`` / ``prepare_model``, ``accumulate`` / ``backward``, the
prepared optimizer (clipping, GradScaler steps) and scheduler, ``LocalSGD``.
"""
