"""The plan of the block's context parallel group: its method, size, this rank and the cp mesh.

Every module of the package reads the block's plan with ``_plan()`` (``None`` without a ``cp``
dim > 1) and passes it down, so the pieces of one call agree on the group. A prepared
attention module keeps the plan it was wired with (a deep copy of the model keeps it too).

Example:
    >>> with accel.distributed(cp_size=2):           # on each of 2 processes
    ...     _plan()
    _Plan(method='alltoall', size=2, rank=0)         # rank 0
    _Plan(method='alltoall', size=2, rank=1)         # rank 1
"""

from __future__ import annotations

from typing import Any

import attrs

from accel.core.state import state

__all__: list[str] = []  # the plan is the package's own: its modules read it


@attrs.frozen
class _Plan:
    """How one context-parallel group splits sequences: its method, size, rank and mesh."""

    method: str
    size: int
    rank: int
    mesh: Any = attrs.field(eq=False, repr=False)  # the cp DeviceMesh

    @property
    def balanced(self) -> bool:
        """Whether shards are head-and-tail (ring: causal work balanced) or contiguous."""
        return self.method == "ring"

    def group(self) -> Any:
        return self.mesh.get_group()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Plan:
        return self  # immutable; a copied model keeps its group


def _plan() -> _Plan | None:
    """The block's plan, or ``None`` without a ``cp`` dim > 1."""
    st = state()
    if st.cp_world_size == 1 or st.mesh is None:
        return None
    return _Plan(st.cp_method or "alltoall", st.cp_world_size, st.cp_rank, st.mesh["cp"])
