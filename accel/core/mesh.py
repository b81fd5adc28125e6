"""N-D device meshes: how the processes split into pipeline, data-parallel and tensor-parallel
groups.

``accel.distributed(pp_size=, dp_replicate_size=, dp_shard_size=, tp_size=, cp_size=)`` (or the
same ``ACCEL_*`` variables, config keys and ``accel launch`` flags) lays the ``world_size``
processes out on a torch ``DeviceMesh`` with the named dimensions
``("pp", "dp_replicate", "dp_shard", "tp")``, made once per block with ``init_device_mesh``. The
tensor-parallel dimension is the innermost (neighbouring ranks, the fastest links), the
pipeline dimension ``pp`` the outermost (stages talk once per microbatch, point to point).
:func:`mesh_shape` decides the sizes; :func:`build_mesh` makes the mesh; :func:`dp_mesh`,
:func:`tp_mesh` and :func:`pp_mesh` give the submeshes ``fully_shard``, ``parallelize_module``
and the pipeline stages run on.

Example:
    >>> mesh_shape(4, "fsdp", {"tp_size": 2})
    MeshShape(dp_replicate=1, dp_shard=2, tp=2, pp=1)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from accel.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DIMS", "SIZE_KEYS", "MeshShape", "build_mesh", "dp_mesh", "mesh_shape", "pp_mesh", "tp_mesh",
]

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimension names, outermost first."""
SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size")
"""The ``distributed()`` options (and config keys) that size the mesh."""


@attrs.frozen
class MeshShape:
    """The size of each mesh dimension; their product is the world size.

    Example:
        >>> MeshShape(2, 1, 2, pp=2).dp_size
        2
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1

    @property
    def dp_size(self) -> int:
        """Processes that see different batches (``dp_replicate * dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> tuple[int, int, int, int]:
        """The sizes in :data:`DIMS` order: ``(pp, dp_replicate, dp_shard, tp)``."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)


def _size(key: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{key}={value!r} must be an integer >= 1, e.g. "
            f"`accel.distributed({key}=2)`."
        )
    return value


def _spelled(sizes: Mapping[str, int | None], world_size: int) -> str:
    given = ", ".join(f"{k}={v}" for k, v in sizes.items() if v is not None)
    return f"{given or 'no sizes'} (world_size={world_size})"


def mesh_shape(
    world_size: int, strategy: str | None, sizes: Mapping[str, object], *, device_type: str = "cpu"
) -> MeshShape | None:
    """The mesh for ``sizes`` (the options of :data:`SIZE_KEYS`), or ``None`` when none is set.

    One size left unset takes what the others leave: ``dp_shard_size`` under
    ``strategy="fsdp"``, else ``dp_replicate_size``; the others (``tp_size``, ``pp_size``)
    default to 1.

    Raises:
        ConfigError: a size that is not an integer >= 1, sizes whose product is not the world
            size (naming every size), ``cp_size > 1`` (context parallelism needs CUDA
            attention kernels), or ``dp_shard_size > 1`` with a strategy other than fsdp.

    Example:
        >>> mesh_shape(4, None, {"dp_replicate_size": 2, "tp_size": 2})
        MeshShape(dp_replicate=2, dp_shard=1, tp=2, pp=1)
    """
    checked = {key: _size(key, sizes.get(key)) for key in SIZE_KEYS}
    unknown = sorted(set(sizes) - set(SIZE_KEYS))
    if unknown:
        raise ConfigError(f"Unknown mesh size option(s) {unknown}; the sizes are {SIZE_KEYS}.")
    if all(v is None for v in checked.values()):
        return None
    cp = checked.pop("cp_size")
    if cp is not None and cp > 1:
        where = "on CPU" if device_type == "cpu" else "in accel yet"
        raise ConfigError(
            f"cp_size={cp}: context parallelism is not available {where} (it needs CUDA "
            "attention kernels and ring attention, which accel does not provide). Leave "
            "cp_size unset or 1, and use dp_shard_size / tp_size to split the work."
        )
    pp = checked.pop("pp_size")
    named = {**checked, "cp_size": cp, "pp_size": pp}
    replicate, shard, tp = (checked["dp_replicate_size"], checked["dp_shard_size"],
                            checked["tp_size"])
    if shard is not None and shard > 1 and strategy not in (None, "fsdp"):
        raise ConfigError(
            f"dp_shard_size={shard} shards parameters with FSDP, but strategy={strategy!r}. "
            "Use `strategy='fsdp'` (or leave it unset), or set dp_replicate_size instead."
        )
    known = [v for v in (replicate, shard, tp, pp) if v is not None]
    product = 1
    for value in known:
        product *= value
    if world_size % product:
        divisor = max(d for d in range(1, (tp or 1) + 1) if world_size % d == 0)
        raise ConfigError(
            f"The mesh sizes {_spelled(named, world_size)} "
            "do not divide "
            f"the {world_size} processes (their product is {product}). Choose sizes whose "
            f"product divides {world_size}, e.g. `accel.distributed(tp_size={divisor})` with "
            "the data-parallel size left unset to take what remains."
        )
    fsdp = strategy == "fsdp" or (shard is not None and shard > 1)
    tp = 1 if tp is None else tp
    pp = 1 if pp is None else pp
    inner = world_size // pp  # the processes of one pipeline stage
    if replicate is None and shard is None:
        replicate, shard = (1, inner // tp) if fsdp else (inner // tp, 1)
    elif shard is None:
        assert replicate is not None
        shard = inner // (replicate * tp) if fsdp else 1
    elif replicate is None:
        replicate = inner // (shard * tp)
    assert replicate is not None
    assert shard is not None
    shape = MeshShape(replicate, shard, tp, pp=pp)
    if shape.dp_size * tp * pp != world_size:
        raise ConfigError(
            f"The mesh sizes {_spelled(named, world_size)} "
            f"multiply to {shape.dp_size * tp * pp}, not the world size {world_size}"
            f"{'' if fsdp else ' (dp_shard_size is 1 unless strategy is fsdp)'}. Leave "
            "dp_replicate_size or dp_shard_size unset to take what remains, or make the "
            "product of the sizes the world size."
        )
    return shape


def build_mesh(device_type: str, shape: MeshShape) -> DeviceMesh:
    """The job's DeviceMesh with dimensions :data:`DIMS` (every rank must call it).

    Example:
        >>> mesh = build_mesh("cpu", MeshShape(1, 2, 2))
        >>> mesh.mesh_dim_names
        ('pp', 'dp_replicate', 'dp_shard', 'tp')
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape.sizes(), mesh_dim_names=DIMS)


def dp_mesh(mesh: Any) -> DeviceMesh:
    """The data-parallel submesh: ``("dp_replicate", "dp_shard")`` for HSDP, else ``dp_shard``.

    A 2-D result is what ``fully_shard`` takes for HSDP (replicate across the first dimension,
    shard within the second).

    Example:
        >>> dp_mesh(accel.state().mesh).mesh_dim_names
        ('dp_shard',)
    """
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]  # type: ignore[no-any-return]
    return mesh["dp_shard"]  # type: ignore[no-any-return]


def tp_mesh(mesh: Any) -> DeviceMesh:
    """The tensor-parallel submesh (``parallelize_module`` runs on it).

    Example:
        >>> tp_mesh(accel.state().mesh).size()
        2
    """
    return mesh["tp"]  # type: ignore[no-any-return]


def pp_mesh(mesh: Any) -> DeviceMesh:
    """The pipeline submesh: this rank's stage neighbours (send/recv run on its group).

    Example:
        >>> pp_mesh(accel.state().mesh).size()
        2
    """
    return mesh["pp"]  # type: ignore[no-any-return]
