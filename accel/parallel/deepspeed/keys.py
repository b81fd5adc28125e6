"""The resolved DeepSpeed config checked against what the installed DeepSpeed reads.

Nothing here lists DeepSpeed's keys: they are found at run time, from DeepSpeed itself.
The config is handed to DeepSpeed's own parser (``DeepSpeedConfig``: its ``get_*`` readers,
its pydantic models, its batch and sanity checks) inside thin ``dict`` wrappers that record
every key DeepSpeed asks for (with the default it would take) and every section it takes
whole (``Model(**section)``, a copy, an iteration). Then:

- a key DeepSpeed never asked for, in a section it read key by key (the top level,
  ``activation_checkpointing``, ``aio``...), is unknown: a ``ConfigError`` naming its path and
  the closest key DeepSpeed asked for there;
- a section taken whole by one of DeepSpeed's pydantic models is checked by the model
  (``extra="forbid"``): its unknown key becomes the same error, the closest name among the
  model's fields; and a boolean is refused where the model's field (or the reader's default)
  is a number: pydantic would take ``true`` for ``1`` (``"stage": true`` would run ZeRO-1);
- any other error DeepSpeed's parser raises (a pydantic ``ValidationError``, an assertion,
  DeepSpeed's ``DeepSpeedConfigError``) becomes a ``ConfigError`` naming the key and value.

A section DeepSpeed keeps as it is for later (``optimizer.params``, handed to the optimizer)
is not checked here; nor are the two keys ``deepspeed.initialize`` reads before its config
class (:data:`INITIALIZE_KEYS`). The model of a section is found by handing DeepSpeed the
section with a probe key its model refuses (the ``ValidationError`` names the model). It costs
a few milliseconds per ``accel.prepare``, nothing per step. Where DeepSpeed is not installed
nothing is checked (the engine refuses to start anyway).
"""

from __future__ import annotations

import difflib
import enum
import importlib
import importlib.util
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from accel.core.settings import did_you_mean
from accel.errors import ConfigError

__all__ = ["check_keys"]

#: Top-level keys ``deepspeed.initialize`` itself reads before DeepSpeed's config class does
#: (its sequence-parallel mesh), so the parser below never asks for them.
INITIALIZE_KEYS = ("sequence_parallel_size", "data_parallel_size")
_NO_DEFAULT = object()
_PROBE = "__accel_probe__"


@attrs.define
class _Reads:
    """What DeepSpeed asked of one section."""

    named: dict[str, object] = attrs.Factory(dict)
    """Key -> the default DeepSpeed would take (``_NO_DEFAULT`` when it gave none)."""
    whole: bool = False
    """Taken whole (unpacked into a model, copied, iterated): any key may be used."""


class _Keys:
    """``section.keys()``: a membership test is a named read, an iteration a whole one."""

    def __init__(self, owner: _Recording) -> None:
        self._owner = owner

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def __iter__(self) -> Iterator[str]:
        self._owner.reads.whole = True
        return iter(list(dict.keys(self._owner)))

    def __len__(self) -> int:
        return dict.__len__(self._owner)


class _Recording(dict[str, Any]):
    """A section of the config that records what DeepSpeed reads of it."""

    def __init__(self, data: Mapping[str, Any], path: str, log: dict[str, _Reads]) -> None:
        super().__init__({k: _wrap(v, _join(path, k), log) for k, v in data.items()})
        self.path = path
        self.reads = log.setdefault(path, _Reads())

    def _named(self, key: object, default: object = _NO_DEFAULT) -> None:
        if isinstance(key, str):
            self.reads.named.setdefault(key, default)

    def get(self, key: str, default: Any = None) -> Any:
        self._named(key, default)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self._named(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._named(key)
        return super().__contains__(key)

    def pop(self, key: str, *default: Any) -> Any:
        self._named(key, default[0] if default else _NO_DEFAULT)
        return super().pop(key, *default)

    def keys(self) -> Any:
        return _Keys(self)

    def __iter__(self) -> Iterator[str]:
        self.reads.whole = True
        return super().__iter__()

    def items(self) -> Any:
        self.reads.whole = True
        return super().items()

    def values(self) -> Any:
        self.reads.whole = True
        return super().values()

    def copy(self) -> dict[str, Any]:
        self.reads.whole = True
        return dict(super().items())


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _wrap(value: object, path: str, log: dict[str, _Reads]) -> object:
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return _Recording(value, path, log)
    return value


_PARSER = ("_initialize_params", "_configure_train_batch_size", "_do_sanity_check")


def _deepspeed_config() -> Any:
    """DeepSpeed's config module, or ``None`` when DeepSpeed is not installed (or its config
    class no longer parses in the steps this module drives)."""
    if importlib.util.find_spec("deepspeed") is None:
        return None
    module = importlib.import_module("deepspeed.runtime.config")
    parser = getattr(module, "DeepSpeedConfig", None)
    if parser is None or not all(hasattr(parser, step) for step in _PARSER):
        return None
    return module


def _parse(module: Any, config: Mapping[str, Any], world_size: int,
           checks: bool) -> dict[str, _Reads]:
    """Run DeepSpeed's parser on ``config`` (its batch and sanity checks when ``checks``);
    what it read of each section."""
    log: dict[str, _Reads] = {}
    recording = _Recording(config, "", log)
    parsed = module.DeepSpeedConfig.__new__(module.DeepSpeedConfig)
    parsed._param_dict = recording
    parsed.global_rank, parsed.world_size = 0, world_size
    removed = getattr(module, "_reject_removed_config_keys", None)
    if removed is not None:  # DeepSpeed's own refusal of removed features (unrecorded)
        removed(dict(config))
    parsed._initialize_params(recording)
    if checks:
        parsed._configure_train_batch_size()
        parsed._do_sanity_check()
    kept: list[tuple[object, int]] = [(v, 0) for k, v in vars(parsed).items()
                                      if k != "_param_dict"]
    while kept:  # a section DeepSpeed keeps as it is (optimizer params) is used later whole
        value, depth = kept.pop()
        if isinstance(value, _Recording):
            value.reads.whole = True
        if depth < 3 and isinstance(value, dict | list | tuple):
            items = dict.values(value) if isinstance(value, dict) else value
            kept.extend((item, depth + 1) for item in items)
    return log


def check_keys(config: Mapping[str, Any], *, world_size: int, checks: bool = True) -> None:
    """Refuse what the installed DeepSpeed would ignore, misread or reject in ``config``.

    Args:
        config: the config about to be handed to DeepSpeed (every ``"auto"`` filled).
        world_size: the processes DeepSpeed divides the batch over (its batch check).
        checks: also run DeepSpeed's batch-size and sanity checks (``False``: only its
            readers and models).

    Raises:
        ConfigError: an unknown key (its path and the closest known name), a boolean where
            DeepSpeed reads a number, or a value DeepSpeed's own checks refuse (key and value).

    Example:
        >>> check_keys({"zero_optimisation": {"stage": 3}}, world_size=2)
        Traceback (most recent call last):
        ConfigError: The DeepSpeed config's key 'zero_optimisation' is not one ...
    """
    module = _deepspeed_config()
    if module is None:
        return
    pydantic = importlib.import_module("pydantic")
    try:
        log = _parse(module, config, world_size, checks)
    except pydantic.ValidationError as exc:
        raise _validation_error(module, config, exc) from None
    except (module.DeepSpeedConfigError, AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"DeepSpeed refuses the config: {str(exc).rstrip('.') or type(exc).__name__}. "
            "Fix that key in the DeepSpeed config (see DeepSpeed's configuration reference)."
        ) from None
    for path in sorted(log, key=lambda p: p.count(".") + bool(p)):  # parents first
        reads, section = log[path], _at(config, path)
        parent, _, key = path.rpartition(".")
        if path and (parent not in log or log[parent].whole or key not in log[parent].named):
            continue  # DeepSpeed took its parent whole: the parent's model checks it
        if reads.whole or not reads.named or not isinstance(section, Mapping):
            continue  # taken whole, or handed on unread (to a model, to the optimizer)
        asked = list(reads.named) + (list(INITIALIZE_KEYS) if not path else [])
        for key in section:
            if key not in asked:
                raise _unknown(_join(path, key), key, asked)
            _no_bool_for_number(_join(path, key), section[key], reads.named.get(key))
    for key, value in config.items():
        reads = log.get(key, _Reads())
        if isinstance(value, Mapping) and (reads.whole or not reads.named):
            model = _model_of(module, pydantic, key, world_size)
            if model is not None:
                _check_model(model, value, key)


def _at(config: Mapping[str, Any], path: str) -> object:
    node: object = config
    for key in path.split(".") if path else ():
        node = node.get(key) if isinstance(node, Mapping) else None
    return node


def _unknown(path: str, key: str, known: typing.Iterable[str]) -> ConfigError:
    where = path.rpartition(".")[0]
    names = sorted(set(known) - {_PROBE})
    close = difflib.get_close_matches(key, names, n=1) or [
        name for name in names if name.lower() == key.lower()][:1]
    hint = did_you_mean(key, names) or did_you_mean(key.lower(), close)
    fix = f"write `\"{close[0]}\"` instead" if close else f"use one of {names[:12]}"
    return ConfigError(
        f"The DeepSpeed config's key {key!r} is not one the installed DeepSpeed reads "
        f"{'in ' + repr(where) if where else 'at the top level'} (at {path!r}){hint}, so "
        f"DeepSpeed would ignore it: {fix}, or remove the key."
    )


def _is_number(kind: object) -> bool:
    return isinstance(kind, type) and not issubclass(kind, bool) and (
        issubclass(kind, int | float) or (issubclass(kind, enum.Enum) and any(
            isinstance(member.value, int | float) for member in kind)))


def _no_bool_for_number(path: str, value: object, default: object) -> None:
    if isinstance(value, bool) and default is not None and _is_number(type(default)):
        raise _bool_refused(path, value, [type(default)])


def _bool_refused(path: str, value: bool, kinds: list[type]) -> ConfigError:
    choices = ""
    for kind in kinds:
        if issubclass(kind, enum.Enum):
            values = [m.value for m in kind]
            choices = f" ({', '.join(map(str, values[:-1]))} or {values[-1]})"
    return ConfigError(
        f"The DeepSpeed config's {path}={value!r} is a boolean where DeepSpeed reads a "
        f"number{choices}: it would take {value!r} for {int(value)}. Write the number, e.g. "
        f"`\"{path.rpartition('.')[2]}\": {int(value)}`."
    )


def _model_of(module: Any, pydantic: Any, key: str, world_size: int) -> Any:
    """The pydantic model DeepSpeed parses the section ``key`` with (found by handing it a
    probe key the model refuses), or ``None``."""
    probe = {"train_micro_batch_size_per_gpu": 1, key: {_PROBE: 0}}
    try:
        _parse(module, probe, world_size, checks=False)
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            if error["type"] == "extra_forbidden" and error["loc"][-1:] == (_PROBE,):
                model = _model_named(module, exc.title)
                for step in error["loc"][:-1]:
                    model = None if model is None else _field_model(model, str(step))
                return model
    except (module.DeepSpeedConfigError, AssertionError, ValueError, TypeError, KeyError,
            AttributeError):  # a probe DeepSpeed refuses otherwise: no model to check against
        return None
    return None


def _model_named(module: Any, name: str) -> Any:
    base = importlib.import_module("deepspeed.runtime.config_utils").DeepSpeedConfigModel
    stack, seen = [base], set()
    while stack:
        kind = stack.pop()
        if kind.__name__ == name:
            return kind
        seen.add(kind)
        stack.extend(sub for sub in kind.__subclasses__() if sub not in seen)
    return None


def _fields(model: Any) -> dict[str, Any]:
    """A model's fields by every name the config may use (field name and alias)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        out[name] = field
        if field.alias:
            out[field.alias] = field
    return out


def _kinds(annotation: object) -> list[object]:
    """The types an annotation admits (``Optional``/``Union``/``Annotated`` opened)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [k for arg in typing.get_args(annotation) for k in _kinds(arg)]
    if origin is typing.Annotated:
        return _kinds(typing.get_args(annotation)[0])
    return [annotation]


def _field_model(model: Any, name: str) -> Any:
    field = _fields(model).get(name)
    if field is None:
        return None
    base = importlib.import_module("deepspeed.runtime.config_utils").DeepSpeedConfigModel
    return next((k for k in _kinds(field.annotation)
                 if isinstance(k, type) and issubclass(k, base)), None)


def _check_model(model: Any, section: Mapping[str, Any], path: str) -> None:
    """Booleans against a model's number fields, in ``section`` and its sub-models."""
    fields = _fields(model)
    for key, value in section.items():
        field = fields.get(key)
        if field is None:
            continue
        kinds = _kinds(field.annotation)
        if isinstance(value, bool) and not any(
            k is bool or k is typing.Any or k is object for k in kinds
        ) and any(_is_number(k) for k in kinds):
            numbers = [k for k in kinds if isinstance(k, type) and _is_number(k)]
            raise _bool_refused(_join(path, key), value, numbers)
        sub = _field_model(model, key)
        if sub is not None and isinstance(value, Mapping):
            _check_model(sub, value, _join(path, key))


def _validation_error(module: Any, config: Mapping[str, Any], exc: Any) -> ConfigError:
    """A pydantic ``ValidationError`` of DeepSpeed's as a ConfigError naming key and value."""
    error = exc.errors()[0]
    loc = tuple(str(step) for step in error["loc"])
    path = _locate(config, loc, error.get("input"))
    key = loc[-1] if loc else "?"
    if error["type"] == "extra_forbidden":
        model = _model_named(module, exc.title)
        for step in loc[:-1]:
            model = None if model is None else _field_model(model, step)
        known = list(_fields(model)) if model is not None else []
        return _unknown(path, key, known)
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return ConfigError(
        f"DeepSpeed refuses the config's {path}={error.get('input')!r}: {message}. Fix "
        f"`\"{key}\"` in the DeepSpeed config (see DeepSpeed's configuration reference)."
    )


def _locate(config: Mapping[str, Any], loc: tuple[str, ...], value: object) -> str:
    """The full path of the key at pydantic's ``loc`` (relative to the model that failed):
    the config path ending with it whose value is the one refused, else ``loc`` itself."""
    found: list[str] = []
    stack: list[tuple[str, object]] = [("", config)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, Mapping):
            continue
        for key, item in node.items():
            full = _join(path, key)
            if tuple(full.split("."))[-len(loc):] == loc and (item == value or value is None):
                found.append(full)
            stack.append((full, item))
    return min(found, key=len) if found else ".".join(loc)
