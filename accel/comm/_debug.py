"""Debug mode for collectives: compare every rank's call before communicating.

Each rank writes a signature (operation, tensor shapes and dtypes) of its n-th collective to
the process group's key-value store and waits for every rank's. A mismatch raises one error
listing all ranks; a rank that never arrives is named when the wait times out. Only the store
is used, so a broken collective cannot hang the check itself.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from accel.errors import CollectiveMismatchError, CollectiveTimeoutError, NotDistributedError

if TYPE_CHECKING:
    from accel.core.scope import Scope
    from accel.core.state import ProcessState

__all__ = ["check_signatures"]

_PREFIX = "accel/debug"


def _store() -> Any:
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise NotDistributedError(
            "Debug mode needs the process group's key-value store, which this torch version "
            "does not expose. Run without `debug=True` / `ACCEL_DEBUG=1`."
        )
    return getter()


def _format(signatures: list[dict[str, Any]]) -> str:
    lines = []
    for rank, sig in enumerate(signatures):
        shapes = ", ".join(sig["spec"]) if sig["spec"] else "no tensors"
        lines.append(f"  rank {rank}: accel.{sig['op']}({shapes})")
    return "\n".join(lines)


def check_signatures(st: ProcessState, record: Scope, op: str, spec: list[str]) -> None:
    """Raise unless every rank calls collective number ``n`` as ``op`` with the same ``spec``.

    Raises:
        CollectiveMismatchError: ranks disagree on the operation or the shapes/dtypes.
        CollectiveTimeoutError: some ranks did not arrive within the state's timeout.
    """
    store = _store()
    seq = record.collective_seq
    record.collective_seq += 1
    key = f"{_PREFIX}/{seq}/"
    store.set(key + str(st.rank), json.dumps({"op": op, "spec": spec}))
    keys = [key + str(rank) for rank in range(st.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=st.timeout))
    except (RuntimeError, dist.DistError) as exc:
        arrived = [r for r in range(st.world_size) if store.check([key + str(r)])]
        missing = [r for r in range(st.world_size) if r not in arrived]
        raise CollectiveTimeoutError(
            f"accel.{op}() (collective #{seq} of this run) timed out after {st.timeout}s: "
            f"ranks {missing} never arrived (ranks {arrived} did). A rank that skips a "
            "collective, or calls it inside a branch the others do not take, hangs the job: "
            "make every rank make the same collective calls in the same order."
        ) from exc
    signatures = [json.loads(store.get(k)) for k in keys]
    if seq > 0:
        store.delete_key(f"{_PREFIX}/{seq - 1}/{st.rank}")  # everyone has read round seq-1
    if any(sig != signatures[0] for sig in signatures):
        raise CollectiveMismatchError(
            f"Ranks disagree at collective #{seq} of this run:\n{_format(signatures)}\n"
            "Every rank must call the same collective with tensors of the same shapes and "
            "dtypes (pad with `accel.pad_across_processes()` first when sizes differ)."
        )
