"""Which unit serves each engine: :data:`ENGINES`, :func:`engine_for` and
:func:`register_engine`.

Adding an engine is its unit (an :class:`~accel.parallel.engines.base.Engine` subclass, in its
own module or package) plus one entry here, or one :func:`register_engine` call from outside
accel (a test's engine). The facts ``distributed()`` needs before any unit is imported (does it
shard, does it run under mesh dims, which package it needs) are declared with the name in
``accel.core.engine_facts.ENGINE_FACTS``.
"""

from __future__ import annotations

from accel.core.engine_facts import EngineFacts, declare_engine
from accel.errors import ConfigError
from accel.parallel.engines.base import Engine
from accel.parallel.engines.ddp import DDP
from accel.parallel.engines.deepspeed import DeepSpeed
from accel.parallel.engines.fsdp import FSDP

__all__ = ["ENGINES", "engine_for", "register_engine"]

# a plain dict: the hot path (backward, the optimizer step) looks the unit up on every call
ENGINES: dict[str, Engine] = {
    "none": Engine(),
    "ddp": DDP(),
    "fsdp": FSDP(),
    "deepspeed": DeepSpeed(),
}
"""Each ``strategy`` and its unit (frozen and stateless: one instance serves every block)."""


def engine_for(name: str) -> Engine:
    """The unit of a ``strategy``, e.g. of ``accel.state().strategy``.

    Raises:
        ConfigError: no engine has that name.

    Example:
        >>> engine_for("fsdp").name
        'fsdp'
    """
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigError(
            f"strategy={name!r} is not supported; choose one of {list(ENGINES)}, "
            "e.g. `accel.prepare_model(model, strategy='ddp')`."
        ) from None


def register_engine(unit: Engine, facts: EngineFacts | None = None) -> None:
    """Make ``unit`` the engine of ``strategy=unit.name`` (``accel.distributed``,
    ``prepare_model``), with the ``facts`` the core layer needs (default: a replicating
    engine that composes with every mesh dim and needs only torch).

    Registering the same unit class again replaces it (a test module imported twice).

    Raises:
        ConfigError: the name is already another unit's.

    Example:
        >>> @attrs.frozen
        ... class Toy(Engine):
        ...     name: ClassVar[str] = "toy"
        >>> register_engine(Toy())
        >>> with accel.distributed(strategy="toy"):
        ...     model = accel.prepare_model(net)
    """
    known = ENGINES.get(unit.name)
    if known is not None and type(known) is not type(unit):  # the same unit again: idempotent
        raise ConfigError(
            f"strategy={unit.name!r} is already the engine of {type(known).__name__}; give "
            f"{type(unit).__name__} another `name`."
        )
    declare_engine(unit.name, facts if facts is not None else EngineFacts())
    ENGINES[unit.name] = unit
