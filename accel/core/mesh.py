"""N-D device meshes: how the processes split into pipeline, data-parallel, context-parallel
and tensor-parallel groups.

``accel.distributed(pp_size=, dp_replicate_size=, dp_shard_size=, cp_size=, tp_size=)`` (or the
same ``ACCEL_*`` variables, config keys and ``accel launch`` flags) lays the ``world_size``
processes out on a torch ``DeviceMesh`` with the named dimensions
``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, made once per block with
``init_device_mesh``. The tensor-parallel dimension is the innermost (neighbouring ranks, the
fastest links), the pipeline dimension ``pp`` the outermost (stages talk once per microbatch,
point to point). :func:`mesh_shape` decides the sizes; :func:`build_mesh` makes the mesh;
:func:`dp_mesh`, :func:`cp_mesh`, :func:`tp_mesh` and :func:`pp_mesh` give the submeshes
``fully_shard``, context parallelism, ``parallelize_module`` and the pipeline stages run on. As
in torchtitan, the ``cp`` ranks join the FSDP group: ``dp_mesh`` flattens ``dp_shard`` x ``cp``
into one dim (:data:`FLATTENED`), since context parallelism shards activations only.

Example:
    >>> mesh_shape(4, "fsdp", {"tp_size": 2})
    MeshShape(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from accel.core.engine_facts import ENGINE_FACTS, EngineFacts
from accel.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DIMS",
    "FLATTENED",
    "SIZE_KEYS",
    "MeshShape",
    "build_mesh",
    "covered_dims",
    "cp_mesh",
    "dp_mesh",
    "mesh_shape",
    "pp_mesh",
    "tp_mesh",
]

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimension names, outermost first."""
SIZE_KEYS = ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
"""The ``distributed()`` options (and config keys) that size the mesh, in :data:`DIMS` order."""
FLATTENED = {"dp_shard_cp": ("dp_shard", "cp")}
"""Dims :func:`dp_mesh` makes by flattening others: the FSDP group under context parallelism."""


@attrs.frozen
class MeshShape:
    """The size of each mesh dimension; their product is the world size.

    Example:
        >>> MeshShape(2, 1, 1, 2, pp=2).dp_size
        2
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int = 1

    @property
    def dp_size(self) -> int:
        """Processes that see different batches (``dp_replicate * dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> tuple[int, int, int, int, int]:
        """The sizes in :data:`DIMS` order: ``(pp, dp_replicate, dp_shard, cp, tp)``."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)


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
    ``strategy="fsdp"``, else ``dp_replicate_size``; the others (``pp_size``, ``cp_size``,
    ``tp_size``) default to 1.

    Raises:
        ConfigError: a size that is not an integer >= 1, sizes whose product is not the world
            size (naming every size), or ``dp_shard_size > 1`` with a strategy other than fsdp.

    Example:
        >>> mesh_shape(4, None, {"dp_replicate_size": 2, "tp_size": 2})
        MeshShape(dp_replicate=2, dp_shard=1, cp=1, tp=2, pp=1)
    """
    checked = {key: _size(key, sizes.get(key)) for key in SIZE_KEYS}
    unknown = sorted(set(sizes) - set(SIZE_KEYS))
    if unknown:
        raise ConfigError(f"Unknown mesh size option(s) {unknown}; the sizes are {SIZE_KEYS}.")
    if all(v is None for v in checked.values()):
        return None
    pp, replicate, shard, cp, tp = (checked["pp_size"], checked["dp_replicate_size"],
                                    checked["dp_shard_size"], checked["cp_size"],
                                    checked["tp_size"])
    facts = ENGINE_FACTS.get(strategy, EngineFacts()) if strategy is not None else None
    if shard is not None and shard > 1 and facts is not None and not facts.shards_parameters:
        raise ConfigError(
            f"dp_shard_size={shard} shards parameters with FSDP, but strategy={strategy!r}. "
            "Use `strategy='fsdp'` (or leave it unset), or set dp_replicate_size instead."
        )
    if facts is not None and facts.mesh_refusal is not None:
        split = {key: value for key, value in (("pp_size", pp), ("cp_size", cp), ("tp_size", tp))
                 if value is not None and value > 1}
        if split:
            spelled = ", ".join(f"{key}={value}" for key, value in split.items())
            raise ConfigError(
                f"{spelled} with strategy={strategy!r}: {facts.mesh_refusal}. Leave those sizes "
                "unset for this strategy, or use strategy='fsdp' with the mesh sizes."
            )
    known = [v for v in (pp, replicate, shard, cp, tp) if v is not None]
    product = 1
    for value in known:
        product *= value
    if world_size % product:
        divisor = max(d for d in range(1, (tp or 1) + 1) if world_size % d == 0)
        raise ConfigError(
            f"The mesh sizes {_spelled(checked, world_size)} do not divide "
            f"the {world_size} processes (their product is {product}). Choose sizes whose "
            f"product divides {world_size}, e.g. `accel.distributed(tp_size={divisor})` with "
            "the data-parallel size left unset to take what remains."
        )
    fsdp = (facts is not None and facts.shards_parameters) or (shard is not None and shard > 1)
    tp = 1 if tp is None else tp
    pp = 1 if pp is None else pp
    cp = 1 if cp is None else cp
    inner = cp * tp
    stage = world_size // pp  # the processes of one pipeline stage
    if replicate is None and shard is None:
        replicate, shard = (1, stage // inner) if fsdp else (stage // inner, 1)
    elif shard is None:
        assert replicate is not None
        shard = stage // (replicate * inner) if fsdp else 1
    elif replicate is None:
        replicate = stage // (shard * inner)
    assert replicate is not None
    assert shard is not None
    shape = MeshShape(replicate, shard, cp, tp, pp=pp)
    if shape.dp_size * inner * pp != world_size:
        raise ConfigError(
            f"The mesh sizes {_spelled(checked, world_size)} multiply to "
            f"{shape.dp_size * inner * pp}, not the world size {world_size}"
            f"{'' if fsdp else ' (dp_shard_size is 1 unless strategy is fsdp)'}. Leave "
            "dp_replicate_size or dp_shard_size unset to take what remains, or make the "
            "product of the sizes the world size."
        )
    return shape


def build_mesh(device_type: str, shape: MeshShape) -> DeviceMesh:
    """The job's DeviceMesh with dimensions :data:`DIMS` (every rank must call it).

    Example:
        >>> mesh = build_mesh("cpu", MeshShape(1, 2, 1, 2))
        >>> mesh.mesh_dim_names
        ('pp', 'dp_replicate', 'dp_shard', 'cp', 'tp')
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape.sizes(), mesh_dim_names=DIMS)


def dp_mesh(mesh: Any) -> DeviceMesh:
    """The data-parallel submesh FSDP runs on: ``dp_shard`` (flattened with ``cp`` into
    ``dp_shard_cp`` when ``cp`` > 1), with ``dp_replicate`` before it for HSDP.

    A 2-D result is what ``fully_shard`` takes for HSDP (replicate across the first dimension,
    shard within the second). Context-parallel ranks hold the same weights and see the same
    batch (each a piece of its sequence), so they shard the weights and average the gradients
    with the data-parallel ranks, as torchtitan does.

    Example:
        >>> dp_mesh(accel.state().mesh).mesh_dim_names
        ('dp_shard',)
    """
    shard = "dp_shard"
    if mesh["cp"].size() > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", shard]  # type: ignore[no-any-return]
    return mesh[shard]  # type: ignore[no-any-return]


def cp_mesh(mesh: Any) -> DeviceMesh:
    """The context-parallel submesh (the ranks that split one sequence).

    Example:
        >>> cp_mesh(accel.state().mesh).size()
        2
    """
    return mesh["cp"]  # type: ignore[no-any-return]


def covered_dims(name: str) -> tuple[str, ...]:
    """The block mesh's dims a submesh dim stands for (itself, or those it flattens).

    Example:
        >>> covered_dims("dp_shard_cp")
        ('dp_shard', 'cp')
    """
    return FLATTENED.get(name, (name,))


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
