"""torch's pipeline schedules by name, where each one puts the stages, and what it needs.

| name | stages per rank | layout | needs |
| --- | --- | --- | --- |
| ``"GPipe"`` | 1 | - | - |
| ``"1F1B"`` | 1 | - | microbatches >= stages |
| ``"Interleaved1F1B"`` | >= 2 (default 2) | loop | microbatches a multiple of their rounds |
| ``"LoopedBFS"`` | >= 2 (default 2) | loop | - |
| ``"InterleavedZeroBubble"`` | >= 2 (default 2) | loop | as Interleaved1F1B |
| ``"ZBVZeroBubble"`` | 2 | V | - |
| ``"DualPipeV"`` | 2 | V | microbatches >= stages |

*Loop*: rank ``r`` holds stages ``r, r + P, r + 2P, ...``; *V*: rank ``r`` holds stages ``r``
and ``2P - 1 - r`` (the first and the last stage are on rank 0). The rounds of a schedule are
``max(1, microbatches // pp_size)``. Everything is checked before
any stage is built, the same on every rank, and refused with a ``ConfigError`` naming the
schedule and the value.

Example:
    >>> spec = schedule_spec("Interleaved1F1B")
    >>> spec.stages_of(rank=1, pp_size=2, stages_per_rank=2)
    (1, 3)
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from accel.errors import ConfigError

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "check_schedule", "schedule_spec"]

Layout = Literal["single", "loop", "v"]


@attrs.frozen
class ScheduleSpec:
    """One of torch's schedules: its class name, stage layout and microbatch rule.

    Example:
        >>> schedule_spec("1F1B").layout
        'single'
    """

    name: str
    cls_name: str
    layout: Layout
    min_microbatches_is_stages: bool = False
    rounds: bool = False
    zero_bubble: bool = False

    @property
    def default_stages_per_rank(self) -> int:
        """1 for single-stage schedules, 2 for the others."""
        return 1 if self.layout == "single" else 2

    def stages_of(self, rank: int, pp_size: int, stages_per_rank: int) -> tuple[int, ...]:
        """The stage numbers pipeline rank ``rank`` holds, in order."""
        if self.layout == "v":
            return (rank, 2 * pp_size - 1 - rank)
        return tuple(rank + k * pp_size for k in range(stages_per_rank))


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name.lower(): spec for spec in (
        ScheduleSpec("GPipe", "ScheduleGPipe", "single"),
        ScheduleSpec("1F1B", "Schedule1F1B", "single", min_microbatches_is_stages=True),
        ScheduleSpec("Interleaved1F1B", "ScheduleInterleaved1F1B", "loop", rounds=True),
        ScheduleSpec("LoopedBFS", "ScheduleLoopedBFS", "loop"),
        ScheduleSpec("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", "loop",
                     rounds=True, zero_bubble=True),
        ScheduleSpec("ZBVZeroBubble", "ScheduleZBVZeroBubble", "v", zero_bubble=True),
        ScheduleSpec("DualPipeV", "ScheduleDualPipeV", "v", min_microbatches_is_stages=True,
                     zero_bubble=True),
    )
}
"""The schedule names accel takes (any case), from ``torch.distributed.pipelining``."""


def schedule_spec(name: object) -> ScheduleSpec:
    """The schedule called ``name`` (case-insensitive).

    Raises:
        ConfigError: a name torch has no schedule for (the valid ones listed).

    Example:
        >>> schedule_spec("gpipe").name
        'GPipe'
    """
    spec = SCHEDULES.get(name.lower()) if isinstance(name, str) else None
    if spec is None:
        import difflib

        names = [s.name for s in SCHEDULES.values()]
        close = difflib.get_close_matches(str(name).lower(), list(SCHEDULES), n=1, cutoff=0.4)
        hint = f" Did you mean {SCHEDULES[close[0]].name!r}?" if close else ""
        raise ConfigError(
            f"pp_schedule={name!r} is not one of torch's pipeline schedules {names}.{hint}"
        )
    return spec


def check_schedule(
    spec: ScheduleSpec, *, pp_size: int, stages_per_rank: object, microbatches: object,
) -> tuple[int, int]:
    """``(stages_per_rank, microbatches)`` once checked for ``spec`` on ``pp_size`` ranks.

    Raises:
        ConfigError: microbatches that are not an integer >= 1, fewer microbatches than the
            schedule needs, or a number of stages per rank it cannot run.

    Example:
        >>> check_schedule(schedule_spec("1F1B"), pp_size=2, stages_per_rank=None,
        ...                microbatches=4)
        (1, 4)
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(
            f"microbatches={microbatches!r} must be an integer >= 1, e.g. "
            "`accel.prepare_model(model, pp_plan='auto', microbatches=4)`."
        )
    per_rank = spec.default_stages_per_rank if stages_per_rank is None else stages_per_rank
    if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1:
        raise ConfigError(f"stages_per_rank={per_rank!r} must be an integer >= 1.")
    if spec.layout == "single" and per_rank != 1:
        raise ConfigError(
            f"pp_schedule={spec.name!r} runs one stage per rank, not stages_per_rank="
            f"{per_rank}. Use 'Interleaved1F1B', 'LoopedBFS' or 'InterleavedZeroBubble' for "
            "several stages per rank."
        )
    if spec.layout == "v" and per_rank != 2:
        raise ConfigError(
            f"pp_schedule={spec.name!r} runs exactly 2 stages per rank (a V), not "
            f"stages_per_rank={per_rank}."
        )
    stages = pp_size * per_rank
    if spec.min_microbatches_is_stages and microbatches < stages:
        raise ConfigError(
            f"pp_schedule={spec.name!r} needs at least as many microbatches as stages: "
            f"microbatches={microbatches} < {stages} stages. Use `microbatches={stages}` or "
            "more (a batch divisible by it), or 'GPipe'."
        )
    if spec.rounds:
        rounds = max(1, microbatches // pp_size)
        if microbatches % rounds:
            raise ConfigError(
                f"pp_schedule={spec.name!r} needs microbatches to be a multiple of "
                f"microbatches // pp_size ({rounds}): microbatches={microbatches} is not. "
                f"Use a multiple of pp_size={pp_size}."
            )
    return per_rank, microbatches


def build_schedule(
    spec: ScheduleSpec, stages: list[Any], microbatches: int, loss_fn: Any
) -> Any:
    """torch's schedule object over this rank's ``stages`` (``PipelineStage`` objects).

    The schedule does not divide the gradients itself (``scale_grads=False``: torch divides
    every gradient in place, which would divide those accumulated by earlier steps too);
    ``loss_fn`` divides each microbatch's loss by the microbatch count instead, so that with a
    mean loss per microbatch the gradients are the mean over the whole batch, as one process
    computes them.

    Example:
        >>> schedule = build_schedule(schedule_spec("GPipe"), [stage], 4, loss_fn)
    """
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, spec.cls_name)
    target = stages[0] if spec.layout == "single" else stages
    return cls(target, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
