"""Errors that accel raises on purpose.

Every error derives from :class:`AccelError` and from the builtin it specialises, so
``except ValueError`` keeps working for code that does not know accel. Messages say what was
wrong, the value received and how to fix it.
"""

from __future__ import annotations

from attrs.exceptions import FrozenInstanceError

__all__ = [
    "AccelError",
    "CheckpointError",
    "CheckpointArgumentError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "GatedCollectiveError",
    "MainProcessFirstError",
    "NotDistributedError",
    "RemoteError",
    "StateFrozenError",
]


class AccelError(Exception):
    """Base class of every error accel raises on purpose."""


class ConfigError(AccelError, ValueError):
    """An option, environment variable or config value is invalid."""


class NotDistributedError(AccelError, RuntimeError):
    """A collective needs a process group that does not exist."""


class GatedCollectiveError(AccelError, RuntimeError):
    """A collective was called inside a rank-gated function or block (it would hang)."""


class CollectiveMismatchError(AccelError, ValueError):
    """Ranks called a collective with different operations, shapes or dtypes (debug mode)."""


class CollectiveTimeoutError(AccelError, TimeoutError):
    """Some ranks never arrived at a collective (debug mode) or a run exceeded its timeout."""


class MainProcessFirstError(AccelError, RuntimeError):
    """The rank that ran first inside ``main_process_first`` raised; the others are released."""


class RemoteError(AccelError, RuntimeError):
    """An exception raised on another process that could not be sent back as itself."""


class CheckpointError(AccelError, ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not match the objects."""


class CheckpointArgumentError(CheckpointError, TypeError):
    """An argument of a checkpoint function is invalid (e.g. ``step=3.0``): a wrong type or
    value, so it is both a ``ValueError`` and a ``TypeError``."""


class DeviceMapError(AccelError, ValueError):
    """A device map, ``max_memory`` budget or offload setting is invalid or cannot be met."""


class StateFrozenError(AccelError, FrozenInstanceError):
    """An attribute of the process state (``accel.state()``) was set or deleted.

    The state is immutable; a nested ``with accel.distributed(option=value):`` scopes a changed
    option. It is an ``AttributeError`` (and attrs' ``FrozenInstanceError``), as before.
    """

    def __init__(self, message: str) -> None:
        AttributeError.__init__(self, message)
        self.msg = message
