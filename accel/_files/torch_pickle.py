"""Reading a torch pickle without building it: the storages it declares, what it would allocate.

``torch.load(weights_only=True)`` runs no code of the file, but the callables it allows can
still be asked to build large objects from a small file: ``bytearray(2**34)`` or
``torch.FloatTensor(2**34)`` from a number, ``_codecs.encode(..., "hex")`` nested forty times
(each level doubling), ``set(x)`` or ``torch.Size(x)`` of one large string or of an expanded
tensor view referenced a thousand times through the pickle's memo. :class:`Inspector` reads the
same pickle with an unpickler that builds nothing (every global becomes an inert stand-in,
storages are only recorded) and charges each call what it would copy or allocate; a file whose
calls would build more than a few times its own size is refused, and so are callables that
convert tensors (``_rebuild_device_tensor_from_cpu_tensor``) or call other callables
(``_rebuild_from_type_v2`` of anything but a tensor rebuild). ``torch.save`` writes none of this.

Each tensor the pickle rebuilds is charged its full logical size (the element count its size
asks for times its dtype's element size, whatever its strides and storage offset), against a
budget of its own (by default the same as the calls'; a zip's checker gives the file's whole
size): a view that repeats stored values (``torch.zeros(1).expand(2**30)``, 4 GiB from one
stored value) costs what copying, cloning or writing it out would allocate, and is refused
before anything is built. ``torch.save`` writes each view's storage whole, so honest files
stay far below it (tied names that are two views of one storage count twice).

:func:`check_legacy` applies it to a torch file older than the zip format (its five leading
pickles, read through a reader that never asks for more bytes than the file holds), and
:func:`check_loaded` bounds what a loaded state may look like before accel walks it (no cycle,
no nesting beyond 128 levels, no shared containers repeating into a huge tree).
"""

from __future__ import annotations

import codecs
import io
import math
import os
import pickle
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch

from accel.errors import CheckpointError

__all__ = [
    "MAX_LOADED_NODES", "InertObject", "Inspector", "budget_for", "check_legacy", "check_loaded",
    "inert_globals", "inspect",
]

_MAX_GLOBALS = 4096  # distinct globals a pickle may name (torch's use a handful)
_MAX_NUMEL = 1 << 62
_SLACK = 1 << 20  # what any pickle may build beyond 8x its own size
_LINE = 1 << 16  # longest line read for a text opcode (torch's pickles have none this long)
_DEPTH = 128  # as accel's JSON bound
_ANY_ITEMSIZE = 1  # a tensor rebuild whose dtype is not torch's: at least a byte a value
#: How many containers and values a loaded state may hold, counting every repeat of a shared one.
MAX_LOADED_NODES = 10_000_000
_TEXT_CODECS = frozenset({"iso8859-1", "ascii", "utf-8"})  # what pickle's bytes use
_REFUSED = {
    ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): "converts a tensor",
    ("torch._utils", "_rebuild_device_tensor_from_numpy"): "builds a tensor from numpy",
}
# tensor rebuilds: where the shape argument is (the result's size, charged to what copies it)
_TENSORS = {
    ("torch._utils", "_rebuild_tensor"): 2,
    ("torch._utils", "_rebuild_tensor_v2"): 2,
    ("torch._utils", "_rebuild_tensor_v3"): 2,
    ("torch._utils", "_rebuild_qtensor"): 2,
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): 1,
    ("torch._utils", "_rebuild_wrapper_subclass"): 2,
}
_PASS_THROUGH = {("torch._utils", "_rebuild_parameter"), ("torch._utils",
                                                        "_rebuild_parameter_with_state")}
_COPIERS = {("builtins", "set"), ("builtins", "bytearray"), ("collections", "Counter"),
            ("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "complex")}


def _storage_sizes() -> dict[tuple[str, str], int]:
    """Element size of each storage type a weights-only torch file may name: the legacy
    typed storages (also as ``torch.cuda``'s, in files older than torch 2) and the untyped
    one (one byte: its element count is its size)."""
    dtypes = {
        "Double": torch.float64, "Float": torch.float32, "Half": torch.float16,
        "BFloat16": torch.bfloat16, "Long": torch.int64, "Int": torch.int32,
        "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8, "Bool": torch.bool,
        "ComplexDouble": torch.complex128, "ComplexFloat": torch.complex64,
        "QInt8": torch.qint8, "QInt32": torch.qint32, "QUInt8": torch.quint8,
        "QUInt4x2": torch.quint4x2, "QUInt2x4": torch.quint2x4,
    }
    sizes = {("torch.storage", "UntypedStorage"): 1}
    for module in ("torch", "torch.cuda"):
        sizes.update({(module, f"{n}Storage"): d.itemsize for n, d in dtypes.items()})
    return sizes


_SIZES = _storage_sizes()


def _is_tensor_class(where: tuple[str, str]) -> bool:
    module, name = where
    return module in ("torch", "torch.cuda", "torch.sparse", "torch.storage") and (
        name.endswith(("Tensor", "Storage"))
    )


class _StandIn:
    """What every global of the inspected pickle becomes: accepts anything, runs nothing.

    Calling a stand-in class (``REDUCE``, ``NEWOBJ``) charges its inspector for what the real
    callable would build; the instance records that size as its ``weight``.
    """

    where: tuple[str, str] = ("", "")
    inspector: Inspector | None = None
    weight = 0
    shape: Any = None
    itemsize = 0  # a storage's element size (persistent_load's stand-ins)

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        instance = super().__new__(cls)
        if cls.inspector is not None:
            instance.weight = cls.inspector.charge(cls.where, args, kwargs)
            if cls.where == ("torch", "Size") and args:
                instance.shape = args[0]  # a shape given as torch.Size(...)
        return instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> _StandIn:
        del args, kwargs
        return _StandIn()

    def __setstate__(self, state: Any) -> None:
        del state

    def __setitem__(self, key: Any, value: Any) -> None:
        del key, value

    def append(self, value: Any) -> None:
        del value

    def extend(self, values: Any) -> None:
        del values

    def add(self, value: Any) -> None:
        del value


class InertObject:
    """What a class a pickle names becomes under ``torch.load(weights_only=True)`` with
    :func:`inert_globals`: it records its arguments (``_args``) and state (``_state``), and
    runs nothing. ``qualname`` is the name the pickle gave."""

    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:
        inst = object.__new__(cls)
        inst.__dict__["_args"] = args
        return inst

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, value: Any) -> None:
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], dict | None):
            value = value[0]  # (dict, slots) as pickle's BUILD passes it
        self.__dict__["_state"] = value


def inert_globals(names: list[str]) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """``torch.serialization.safe_globals`` entries that load each of ``names`` (e.g. from
    ``get_unsafe_globals_in_checkpoint``, already screened by the caller) as an
    :class:`InertObject` subclass carrying that name.

    Example:
        >>> with torch.serialization.safe_globals(inert_globals(["pkg.Cls"])):
        ...     loaded = torch.load(file, weights_only=True)
    """
    return [(type("StandIn", (InertObject,), {"qualname": n}), n) for n in names]


def _weight(value: Any) -> int:
    """How many elements copying ``value`` takes (a stand-in: what it would have built)."""
    if isinstance(value, _StandIn):
        return value.weight
    if isinstance(value, str | bytes | bytearray | list | tuple | dict | set | frozenset):
        return len(value)
    return 0


def _itemsize(dtype: Any) -> int:
    """The element size of a dtype named in a pickle (``torch.float32``'s stand-in class)."""
    where = getattr(dtype, "where", None) if isinstance(dtype, type) else None
    if isinstance(where, tuple) and where[0] == "torch":
        found = getattr(torch, where[1], None)
        if isinstance(found, torch.dtype):
            return max(found.itemsize, _ANY_ITEMSIZE)
    return _ANY_ITEMSIZE


def _tensor_itemsize(where: tuple[str, str], args: tuple[Any, ...]) -> int:
    """The element size of the tensor a rebuild ``where(*args)`` makes: its storage's (typed
    storages, as ``_rebuild_tensor_v2`` takes), else its dtype argument's."""
    dtype_at = {"_rebuild_tensor_v3": 6, "_rebuild_meta_tensor_no_storage": 0,
                "_rebuild_wrapper_subclass": 1}.get(where[1])
    if dtype_at is not None:
        return _itemsize(args[dtype_at] if len(args) > dtype_at else None)
    storage = args[0] if args else None
    return max(storage.itemsize, _ANY_ITEMSIZE) if isinstance(storage, _StandIn) else (
        _ANY_ITEMSIZE)


def _numel(shape: Any) -> int:
    """The element count a shape argument asks for (0 when it is no shape)."""
    if isinstance(shape, _StandIn):  # torch.Size(...): its weight is its length, not a count
        shape = shape.shape
    if not isinstance(shape, tuple | list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        return 0
    return math.prod(max(d, 0) for d in shape)


class Inspector(pickle.Unpickler):
    """Reads one torch pickle for the storages it declares (``key -> bytes``), refusing what
    would allocate more than ``budget`` (elements copied or bytes allocated by its calls), or
    tensors of more than ``tensor_budget`` bytes in full logical size (default: ``budget``).

    ``refuse(what)`` makes the error raised for a refused pickle; ``oversized(what)`` the one
    for tensors over their budget (default: ``refuse``).
    """

    def __init__(
        self, file: IO[bytes], refuse: Callable[[str], CheckpointError], budget: int,
        *, tensor_budget: int | None = None,
        oversized: Callable[[str], CheckpointError] | None = None,
    ) -> None:
        super().__init__(file, encoding="utf-8")
        self.refuse = refuse
        self.oversized = refuse if oversized is None else oversized
        self.budget = budget
        self.spent = 0
        self.tensor_budget = budget if tensor_budget is None else tensor_budget
        self.tensor_bytes = 0  # the logical size of every tensor rebuilt so far
        self.globals: dict[tuple[str, str], type[_StandIn]] = {}
        self.storages: dict[str, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in NAME_MAPPING:  # Python 2 names, as protocol 2 writes (and torch
            module, name = NAME_MAPPING[(module, name)]  # reads) them: __builtin__.set
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        where = (module, name)
        found = self.globals.get(where)
        if found is None:
            if where in _REFUSED:
                raise self.refuse(f"calls {module}.{name}, which {_REFUSED[where]}")
            if len(self.globals) >= _MAX_GLOBALS:
                raise self.refuse(f"names over {_MAX_GLOBALS} globals")
            found = type("StandIn", (_StandIn,), {"where": where, "inspector": self})
            self.globals[where] = found
        return found

    def charge(self, where: tuple[str, str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """What calling ``where`` with ``args`` builds; refuses past the budget."""
        weight, cost = self._cost(where, args)
        cost += sum(_weight(v) for v in kwargs.values())
        self.spent += cost
        if self.spent > self.budget:
            raise self.refuse(
                f"would build over {self.budget} bytes or elements through its calls "
                f"({where[0]}.{where[1]} brings it to {self.spent}), far more than the file holds"
            )
        return weight

    def _cost(self, where: tuple[str, str], args: tuple[Any, ...]) -> tuple[int, int]:
        """``(weight of the result, cost of the call)``."""
        if where in _TENSORS:
            index = _TENSORS[where]
            numel = _numel(args[index] if len(args) > index else None)
            self._charge_tensor(where, numel * _tensor_itemsize(where, args))
            return numel, 0
        if where in _PASS_THROUGH:
            return (_weight(args[0]) if args else 0), 0
        if where == ("torch._tensor", "_rebuild_from_type_v2"):
            inner = args[0] if args else None
            target = getattr(inner, "where", None)
            if not (isinstance(inner, type) and issubclass(inner, _StandIn)) or (
                target not in _TENSORS and target not in _PASS_THROUGH
            ):
                raise self.refuse(f"rebuilds a tensor through {target or inner!r:.60}")
            call_args = args[2] if len(args) > 2 and isinstance(args[2], tuple) else ()
            return self._cost(target, call_args)
        if where == ("_codecs", "encode"):
            text = args[0] if args else None
            codec = args[1] if len(args) > 1 else "utf-8"
            try:
                name = codecs.lookup(codec).name if isinstance(codec, str) else None
            except LookupError:
                name = None
            if not isinstance(text, str) or name not in _TEXT_CODECS:
                raise self.refuse(
                    f"calls _codecs.encode on {type(text).__name__} with {codec!r:.40} "
                    "(pickle encodes bytes as text with 'latin1')"
                )
            return 4 * len(text), 4 * len(text)
        if where in _COPIERS or _is_tensor_class(where):
            counts = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
            # a number asks for that many elements (of up to 16 bytes each for a tensor)
            scale = 1 if where == ("builtins", "bytearray") else 16
            made = scale * math.prod(max(c, 0) for c in counts) if counts and where != (
                "builtins", "complex") else 0
            cost = made + sum(_weight(a) for a in args)
            return cost, cost
        return sum(_weight(a) for a in args), 0

    def _charge_tensor(self, where: tuple[str, str], nbytes: int) -> None:
        """Charge one rebuilt tensor its full logical size; refuse past the tensor budget."""
        self.tensor_bytes += nbytes
        if self.tensor_bytes > self.tensor_budget:
            raise self.oversized(
                f"would make {self.tensor_bytes} bytes of tensors in full logical size "
                f"(element count times element size; {where[0]}.{where[1]} of {nbytes} bytes "
                f"brings it there), more than the {self.tensor_budget} bytes accel reads from "
                "this file"
            )

    def persistent_load(self, pid: Any) -> Any:
        # zip: ('storage', type, key, location, numel); legacy: ..., numel, view metadata
        if not isinstance(pid, tuple) or len(pid) not in (5, 6) or _text(pid[0]) != "storage":
            raise self.refuse(f"holds the unknown reference {pid!r:.80}")
        kind, key, numel = pid[1], _text(pid[2]), pid[4]
        where = getattr(kind, "where", None) if isinstance(kind, type) else None
        itemsize = _SIZES.get(where) if isinstance(where, tuple) else None
        if itemsize is None:
            raise self.refuse(f"names the unknown storage type {kind!r:.80}")
        if key is None or type(numel) is not int or not 0 <= numel <= _MAX_NUMEL:
            raise self.refuse(f"declares a storage as {pid[2]!r:.40} of {numel!r:.40} elements")
        nbytes = numel * itemsize
        if self.storages.setdefault(key, nbytes) != nbytes:
            raise self.refuse(
                f"declares storage {key!r} as both {self.storages[key]} and {nbytes} bytes"
            )
        storage = _StandIn()
        storage.itemsize = itemsize
        return storage


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def budget_for(size: int) -> int:
    """What a pickle (or the tensors of a file) of ``size`` bytes may build: 8 times its size
    plus 1 MiB.

    Example:
        >>> budget_for(0)
        1048576
    """
    return 8 * size + _SLACK


def inspect(
    file: IO[bytes], size: int, refuse: Callable[[str], CheckpointError],
    *, tensor_budget: int | None = None,
    oversized: Callable[[str], CheckpointError] | None = None,
) -> Inspector:
    """Read one pickle from ``file`` (of ``size`` bytes at most) with an :class:`Inspector`.

    Args:
        file: the pickle's bytes, read from their start.
        size: how many bytes it has at most: its calls may build :func:`budget_for` it.
        refuse: the error for a pickle that cannot be read or would build too much.
        tensor_budget: the most bytes its tensors may have in full logical size (default: what
            its calls may build).
        oversized: the error for tensors over ``tensor_budget`` (default: ``refuse``).

    Raises:
        CheckpointError: ``refuse(...)`` for a pickle that cannot be read or would build too
            much, ``oversized(...)`` for tensors over their budget.

    Example:
        >>> inspect(io.BytesIO(data), len(data), refuse).storages
        {'0': 16}
    """
    inspector = Inspector(file, refuse, budget_for(size), tensor_budget=tensor_budget,
                          oversized=oversized)
    try:
        inspector.load()
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged pickle fails with many error types
        raise refuse(f"cannot be read ({type(exc).__name__}: {exc})") from None
    return inspector


class _Bounded(io.RawIOBase):
    """A read-only view of an open file that never asks for more bytes than are left in it
    (Python's buffered ``read(n)`` reserves ``n`` bytes before reading)."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        super().__init__()
        self.fd, self.position, self.size = fd, start, size

    def readable(self) -> bool:
        return True

    def peek(self, size: int = 0) -> bytes:
        """Bytes ahead, without moving (the unpickler reads ahead in chunks with it)."""
        want = min(max(size, 1), _LINE, max(self.size - self.position, 0))
        return os.pread(self.fd, want, self.position) if want else b""

    def read(self, size: int | None = -1) -> bytes:
        left = max(self.size - self.position, 0)
        want = left if size is None or size < 0 else min(size, left)
        data = os.pread(self.fd, want, self.position) if want else b""
        self.position += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), max(self.size - self.position, 0))
        if want <= 0:
            return 0
        data = os.pread(self.fd, want, self.position)
        view[: len(data)] = data
        self.position += len(data)
        return len(data)

    def readline(self, size: int | None = -1) -> bytes:
        limit = _LINE if size is None or size < 0 else min(size, _LINE)
        data = os.pread(self.fd, min(limit, max(self.size - self.position, 0)), self.position)
        end = data.find(b"\n")
        line = data if end < 0 else data[: end + 1]
        self.position += len(line)
        return line


def check_legacy(
    file: IO[bytes], where: str, refuse: Callable[[str], CheckpointError],
    oversized: Callable[[str], CheckpointError] | None = None,
) -> None:
    """Check a torch file older than the zip format (or a bare pickle) before torch reads it.

    Such a file is five pickles (magic number, protocol, system info, the object, the storage
    keys) followed by each storage's bytes; torch reads a bare pickle's first object as the
    magic number. Each pickle is inspected in turn (never reading past the file's end), and
    the storages the object declares must fit in the file.

    Raises:
        CheckpointError: ``refuse(...)``: a pickle that cannot be read, would build far more
            than the file holds, or declares more storage than the file has;
            ``oversized(...)`` (default ``refuse``): tensors of more than
            :func:`budget_for` the file's size in full logical size.
    """
    del where
    fd = file.fileno()
    size = os.fstat(fd).st_size
    if size == 0:  # an empty file, or one that states no size (/proc): nothing to check
        raise refuse("is empty (or states no size, as /proc files do)")
    reader = _Bounded(fd, 0, size)
    found: dict[str, int] = {}
    for _ in range(5):
        if reader.position >= size:
            return  # torch says what is missing
        found.update(inspect(reader, size, refuse,  # type: ignore[arg-type]
                             oversized=oversized).storages)
    declared = sum(found.values())
    if declared > size - reader.position:
        raise refuse(
            f"declares {declared} bytes of storage, the file holds "
            f"{size - reader.position} after it"
        )


def check_loaded(value: Any, refuse: Callable[[str], CheckpointError]) -> None:
    """Refuse a loaded state that is cyclic, nested deeper than 128 levels, or whose shared
    containers repeat into more than :data:`MAX_LOADED_NODES` values when walked as a tree
    (what an optimizer's ``load_state_dict`` does). Linear in the distinct containers.

    Raises:
        CheckpointError: ``refuse(what)``.
    """
    sizes: dict[int, int] = {}  # container id -> values in its tree, when done
    depths: dict[int, int] = {}
    open_now: set[int] = set()  # the containers on the path being walked
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_now.discard(key)
            inner = [c for c in _children(node) if _is_container(c)]
            sizes[key] = 1 + len(_children(node)) + sum(sizes[id(c)] for c in inner)
            depths[key] = 1 + max((depths[id(c)] for c in inner), default=0)
            if sizes[key] > MAX_LOADED_NODES:
                raise refuse(f"repeats shared containers into over {MAX_LOADED_NODES} values")
            if depths[key] > _DEPTH:
                raise refuse(f"nests more than {_DEPTH} levels deep")
            continue
        if not _is_container(node) or key in sizes:
            continue
        if key in open_now:
            raise refuse("holds a container that holds itself (a cycle)")
        if len(open_now) > _DEPTH:
            raise refuse(f"nests more than {_DEPTH} levels deep")
        open_now.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if _is_container(c))


def _is_container(node: Any) -> bool:
    return isinstance(node, Mapping | list | tuple | set | frozenset)


def _children(node: Any) -> list[Any]:
    """What a container holds (a mapping's keys and values)."""
    if isinstance(node, Mapping):
        return [*node.keys(), *node.values()]
    return list(node)
