"""The core: every setting defined once, the launch environment (the only reader of
``os.environ``), the config file, the device mesh's shape, ``ProcessState`` in its ContextVar
with the block's ``Scope``, and ``distributed()``.

Every other package builds on these modules; they import nothing above them.
"""

__all__: list[str] = []  # the modules are imported on their own
