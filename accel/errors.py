"""Errors that accel raises on purpose.

Every error derives from :class:`AccelError` and from the builtin it specialises, so
``except ValueError`` keeps working for code that does not know accel. Messages say what was
wrong, the value received and how to fix it.
"""

from __future__ import annotations

from attrs.exceptions import FrozenInstanceError

__all__ = [
    "AbortedError",
    "AccelError",
    "ArgumentTypeError",
    "ArrivalTimeoutError",
    "CheckpointArgumentError",
    "CheckpointCancelledError",
    "CheckpointError",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CollectiveTypeError",
    "ConfigError",
    "ConfigTypeError",
    "DataLoaderTypeError",
    "DeviceMapError",
    "GatedCollectiveError",
    "LaunchError",
    "LogValueError",
    "MachineBedError",
    "MachineBedTimeoutError",
    "MachineLostError",
    "MainProcessFirstError",
    "NoExecutableBatchSizeError",
    "NotDistributedError",
    "NotPicklableError",
    "OtherRankFailedError",
    "RemoteError",
    "SelfTestError",
    "StaleParametersError",
    "StateFrozenError",
    "TrackerUnavailableError",
    "TrackingNotActiveError",
]


class AccelError(Exception):
    """Base class of every error accel raises on purpose.

    Example:
        >>> try:
        ...     with accel.distributed(mixed_precison="bf16"):  # a typo
        ...         pass
        ... except accel.AccelError as exc:
        ...     print(type(exc).__name__)
        ConfigError
    """


class ConfigError(AccelError, ValueError):
    """An option, environment variable or config value is invalid.

    Example:
        >>> with accel.distributed(mixed_precision="bf17"):
        ...     pass
        Traceback (most recent call last):
        accel.errors.ConfigError: mixed_precision='bf17' is not supported; choose one of
        ['no', 'fp16', 'bf16', 'fp8'], e.g. `accel.distributed(mixed_precision='bf16')`.
    """


class ConfigTypeError(ConfigError, TypeError):
    """A setting has a type the config file cannot hold (e.g. a list where a number goes)."""


class AbortedError(ConfigError):
    """The ``accel config`` questionnaire's input ended before all questions were answered."""


class ArgumentTypeError(AccelError, TypeError):
    """An accel function or object received an argument of the wrong kind.

    For example ``accel.prepare_model("model")``, ``@accel.on_process(-1)`` or
    ``accel.progress(42)``.
    """


class NotPicklableError(AccelError, TypeError):
    """An accel object that must not be pickled was pickled (e.g. a prepared optimizer)."""


class NotDistributedError(AccelError, RuntimeError):
    """A collective needs a process group that does not exist."""


class GatedCollectiveError(AccelError, RuntimeError):
    """A collective was called inside a rank-gated function or block (it would hang)."""


class CollectiveMismatchError(AccelError, ValueError):
    """Ranks called a collective with different operations, shapes or dtypes (debug mode), or
    different calls that every rank must make (``save_state`` on one, ``load_state`` on
    another), or were fed batches of different shapes where they pass pieces of one batch
    (a pipeline's stages, a context-parallel group)."""


class CollectiveArgumentError(AccelError, ValueError):
    """A collective got an invalid argument value (e.g. ``reduction="avg"``,
    ``from_process=5`` on 2 processes)."""


class CollectiveTypeError(ArgumentTypeError):
    """A collective got a value of a type it cannot handle (e.g. a string to ``gather``)."""


class CollectiveTimeoutError(AccelError, TimeoutError):
    """Some ranks never arrived at a collective (debug mode) or a run exceeded its timeout.

    Example:
        >>> try:
        ...     accel.wait_for_everyone()
        ... except accel.CollectiveTimeoutError as exc:  # names the ranks that never came
        ...     accel.print(exc)
        ...     raise
    """


class ArrivalTimeoutError(CollectiveTimeoutError):
    """Some ranks never arrived at a call every rank must make (``save_state``,
    ``load_state``, ``wait_for_everyone``...) within ``arrival_timeout``: usually the call sits
    inside ``if accel.is_main_process:``."""


class MachineBedError(AccelError, RuntimeError):
    """The namespaced-machines test bed (:mod:`accel.testing.machines`) could not set up, run
    or tear down a machine (an ``ip``/``unshare`` failure, a bed used after it closed).

    Example:
        >>> raise MachineBedError("ip netns add failed: ...")  # doctest: +SKIP
    """


class MachineBedTimeoutError(AccelError, TimeoutError):
    """A machine's command in the test bed did not end within its timeout.

    Example:
        >>> raise MachineBedTimeoutError("m1 still running after 60 s")  # doctest: +SKIP
    """


class MachineLostError(AccelError, RuntimeError):
    """A machine of the job stopped answering (its processes died, or the link to it is cut):
    named by its hostname, node rank and ranks, with the option that bounds the detection."""


class MainProcessFirstError(AccelError, RuntimeError):
    """The rank that ran first inside ``main_process_first`` raised; the others are released."""


class RemoteError(AccelError, RuntimeError):
    """An exception raised on another process that could not be sent back as itself.

    Example:
        >>> try:
        ...     run_distributed(body, world_size=2)  # accel.testing.run_distributed
        ... except accel.RemoteError as exc:  # names the rank and the exception's type
        ...     print(exc)
    """


class CheckpointError(AccelError, ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not match the objects.

    Example:
        >>> accel.load_state("no-such-ckpt", model=model)
        Traceback (most recent call last):
        accel.errors.CheckpointError: No complete checkpoint at 'no-such-ckpt' (it does not
        exist). Check the path, or pass `missing_ok=True` to start from scratch when there is none.
    """


class CheckpointCancelledError(AccelError, InterruptedError):
    """An asynchronous checkpoint write was stopped (its ``distributed()`` block ended by an
    exception) before it finished; the checkpoint was not made visible."""


class CheckpointArgumentError(CheckpointError, TypeError):
    """An argument of a checkpoint function is invalid (e.g. ``step=3.0``): a wrong type or
    value, so it is both a ``ValueError`` and a ``TypeError``."""


class DataLoaderTypeError(ArgumentTypeError):
    """``prepare_data_loader`` / ``skip_first_batches`` received something else than a loader."""


class NoExecutableBatchSizeError(AccelError, RuntimeError):
    """``find_executable_batch_size``: even a batch size of 1 ran out of memory."""


class OtherRankFailedError(AccelError, RuntimeError):
    """Another rank raised a (non out-of-memory) error during the batch-size search."""


class TrackerUnavailableError(AccelError, ImportError):
    """A tracker named in ``log_with`` needs a package that is not installed."""


class TrackingNotActiveError(AccelError, RuntimeError):
    """``accel.log``/``accel.get_tracker`` was called outside ``with accel.tracking(...)``."""


class LogValueError(ArgumentTypeError, ValueError):
    """A value passed to ``accel.log`` cannot be logged (wrong type or not a scalar)."""


class LaunchError(AccelError, RuntimeError):
    """Processes cannot be launched from here, or a launched process failed.

    Example:
        >>> def train():
        ...     raise ValueError("bad batch")
        >>> accel.debug_launcher(train, num_processes=2)
        Traceback (most recent call last):
        accel.errors.LaunchError: debug_launcher(train) failed: rank 0 raised.
        ----- traceback of rank 0 -----
        ...
        ValueError: bad batch
    """


class SelfTestError(AccelError, AssertionError):
    """A check of ``accel test`` found a wrong result."""


class StaleParametersError(AccelError, ValueError):
    """An optimizer holds parameters that ``prepare_model`` replaced (FSDP sharding swaps a
    model's parameters for sharded ones): it was created before the model was prepared."""


class DeviceMapError(AccelError, ValueError):
    """A device map, ``max_memory`` budget or offload setting is invalid or cannot be met."""


class StateFrozenError(AccelError, FrozenInstanceError):
    """An attribute of the process state (``accel.state()``) was set or deleted.

    The state is immutable; a nested ``with accel.distributed(option=value):`` scopes a changed
    option. It is an ``AttributeError`` (and attrs' ``FrozenInstanceError``).
    """

    def __init__(self, message: str) -> None:
        AttributeError.__init__(self, message)
        self.msg = message
