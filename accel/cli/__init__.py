"""The ``accel`` command: ``main`` (the entry point and its subcommands' parsers), ``launch``
through :mod:`accel.launch`, ``config`` (questionnaire, ``config import``), ``env``, ``test``
(``selftest``), ``estimate-memory`` (``estimate``, ``model_source``), ``merge-weights``
(``merge``, ``checkpoint_source``) and ``checkpoint inspect / verify`` (``checkpoint_report``).

Nothing here is imported by ``import accel``; each module loads on first use.
"""

__all__: list[str] = []  # the modules are imported on their own
