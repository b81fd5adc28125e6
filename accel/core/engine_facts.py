"""What the layers below the engines must know of each engine before any engine runs.

``distributed()`` (in ``accel.core``) shapes the mesh and resolves the policy before any
engine unit is imported (core may not import ``accel.parallel``), so each engine declares
these facts here with its name; everything else an engine does lives in its unit
(``accel.parallel.engines``), whose ``register_engine`` declares a new engine's facts.

Example:
    >>> ENGINE_FACTS["deepspeed"].package
    'deepspeed'
"""

from __future__ import annotations

import attrs

__all__ = ["ENGINE_FACTS", "SHARDING_ENGINE", "EngineFacts", "declare_engine"]


@attrs.frozen
class EngineFacts:
    """What the layers below the engines must know of an engine before it runs.

    ``distributed()`` (in ``accel.core``) shapes the mesh and resolves the policy before any
    engine unit is imported, so each engine declares these facts here; everything else an
    engine does lives in its unit (``accel.parallel.engines``).

    Example:
        >>> ENGINE_FACTS["fsdp"].shards_parameters
        True
    """

    shards_parameters: bool = False
    """Its data-parallel dim shards parameters (``dp_shard_size`` > 1 is its own)."""
    mesh_refusal: str | None = None
    """Why it does not run under pipeline, context or tensor-parallel dims (``None``: it
    does)."""
    package: str | None = None
    """The distribution it needs installed, checked at ``distributed()`` (``None``: torch)."""
    extra: str | None = None
    """accel's extra that installs :attr:`package`, for the message."""
    policy_option: str | None = None
    """The ``distributed()`` keyword whose engine config may set ``mixed_precision`` and
    ``gradient_accumulation_steps`` where nothing else did (DeepSpeed's JSON)."""


ENGINE_FACTS: dict[str, EngineFacts] = {
    "none": EngineFacts(),
    "ddp": EngineFacts(),
    "fsdp": EngineFacts(shards_parameters=True),
    "deepspeed": EngineFacts(
        mesh_refusal="DeepSpeed's ZeRO partitions over every process and accel does not "
        "compose it with pipeline, context or tensor parallelism",
        package="deepspeed", extra="deepspeed", policy_option="deepspeed_config",
    ),
}
"""Each ``strategy`` name and its facts; ``accel.parallel.engines.register_engine`` adds an
engine's (through :func:`declare_engine`)."""


SHARDING_ENGINE = "fsdp"
"""The engine a block gets when only its mesh shards parameters (``dp_shard_size`` > 1)."""


def declare_engine(name: str, facts: EngineFacts) -> None:
    """Make ``name`` a ``strategy`` choice with ``facts`` (called by ``register_engine``).

    Example:
        >>> declare_engine("toy", EngineFacts())
    """
    ENGINE_FACTS[name] = facts
