"""The model a memory estimate is about, built without allocating its weights.

A source is one of:

* a ``torch.nn.Module`` (used as it is, real or on the meta device);
* a transformers config object (``PretrainedConfig``);
* a path to a transformers ``config.json``, or to a directory holding one;
* ``"module:callable"`` (``"my_pkg.models:build"``): the callable is imported and called with
  no arguments, and must return a module.

Configs and callables are built under :func:`accel.init_empty_weights`, so a model of any size
costs no memory, and nothing is downloaded: a config's class must be one the installed
transformers knows (no remote code is run).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from torch import nn

from accel.errors import ArgumentTypeError, CheckpointError, ConfigError

__all__ = ["ModelSource", "build_model"]

ModelSource = nn.Module | str | os.PathLike[str] | Any  # Any: a transformers config object
_CONFIG = "config.json"
_MAX_CONFIG_BYTES = 16 << 20


def _read_config(path: Path) -> dict[str, Any]:
    from accel._files.safe_io import load_json, read_bounded

    where = os.fspath(path)
    try:  # a link is followed (the Hugging Face cache links files to blobs), a FIFO is not
        raw = read_bounded(path, _MAX_CONFIG_BYTES, follow_links=True)
        data = load_json(raw, lambda problem: CheckpointError(problem))
    except FileNotFoundError:
        raise ConfigError(f"The model config {where!r} does not exist.") from None
    except (OSError, CheckpointError) as exc:
        raise ConfigError(
            f"The model config {where!r} cannot be read as JSON ({exc}). Give a transformers "
            "config.json (as `config.save_pretrained(dir)` writes it)."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"The model config {where!r} holds a JSON {type(data).__name__}, not an object; a "
            "transformers config.json is an object with a 'model_type'."
        )
    return data


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "Building a model from a config.json needs transformers, which is not installed. "
            "Install it (`pip install transformers`), or give `module:callable` returning the "
            "model."
        ) from None
    return transformers


def _config_object(data: dict[str, Any], where: str) -> Any:
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(
            f"The model config {where!r} has no 'model_type' (got {model_type!r}), so the model "
            "class is unknown. Give a config.json written by transformers "
            "(`config.save_pretrained(dir)`)."
        )
    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        raise ConfigError(
            f"The model config {where!r} has model_type={model_type!r}, which transformers "
            f"{transformers.__version__} does not know (accel runs no remote code). Upgrade "
            "transformers, or give `module:callable` returning the model."
        ) from None
    return config_class.from_dict(dict(data))


def _from_config(config: Any, where: str) -> nn.Module:
    """The model class the config names (``architectures``), else a causal LM, else AutoModel."""
    transformers = _transformers()
    from accel.big_model import init_empty_weights

    attempts: list[Any] = []
    for name in getattr(config, "architectures", None) or []:
        found = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(found, type):
            attempts.append(found)
    attempts += [transformers.AutoModelForCausalLM, transformers.AutoModel]
    problems = []
    for builder in attempts:
        try:
            with init_empty_weights():
                if hasattr(builder, "from_config"):
                    model = builder.from_config(config)
                else:
                    model = builder(config)
        except Exception as exc:  # not this auto class's kind, a missing optional package...
            problems.append(f"{getattr(builder, '__name__', builder)}: {type(exc).__name__}: "
                            f"{exc}")
            continue
        if isinstance(model, nn.Module):
            return model
    raise ConfigError(
        f"No transformers model class could be built from {where} "
        f"({'; '.join(problems)[:600]}). Give `module:callable` returning the model instead."
    )


def _from_callable(spec: str) -> tuple[nn.Module, str]:
    from accel.big_model import init_empty_weights

    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` finds modules of the current directory
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # not found, or the module itself fails
        raise ConfigError(
            f"Cannot import {module_name!r} for the model {spec!r} ({type(exc).__name__}: "
            f"{exc}). Give `package.module:function` importable from the current directory or "
            "sys.path."
        ) from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(
                f"{module_name!r} has no attribute {attribute!r} (the model {spec!r}). Give "
                "`module:callable`, the callable returning the model."
            )
        found = getattr(found, part)
    if not callable(found):
        raise ArgumentTypeError(
            f"{spec!r} is a {type(found).__name__}, not a callable; give `module:callable` "
            "whose callable returns the model."
        )
    try:
        with init_empty_weights():
            model = found()
    except Exception as exc:
        raise ConfigError(
            f"Calling {spec!r} to build the model raised {type(exc).__name__}: {exc}. It is "
            "called with no arguments (under accel.init_empty_weights()); wrap it in a "
            "function that takes none."
        ) from exc
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"{spec!r} returned a {type(model).__name__}, not a torch.nn.Module; the callable "
            "must return the model."
        )
    return model, spec


def _looks_like_callable(text: str) -> bool:
    module, colon, attribute = text.partition(":")
    return bool(colon) and bool(module) and bool(attribute) and all(
        part.isidentifier() for part in [*module.split("."), *attribute.split(".")]
    )


def build_model(source: ModelSource) -> tuple[nn.Module, str]:
    """The model of ``source`` (see the module docstring) and a description of where from.

    Raises:
        ConfigError: a missing or unreadable config, an unknown ``model_type``, a callable
            that cannot be imported, or transformers missing.
        ArgumentTypeError: ``source`` is none of the accepted kinds, or the callable returns
            something other than a module.

    Example:
        >>> model, where = build_model("checkpoints/config.json")
    """
    if isinstance(source, nn.Module):
        return source, type(source).__name__
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):  # a transformers config
        return _from_config(source, f"the {type(source).__name__}"), type(source).__name__
    if isinstance(source, str) and _looks_like_callable(source) and not os.path.exists(source):
        return _from_callable(source)
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        if path.is_dir():
            if not (path / _CONFIG).exists():
                raise ConfigError(
                    f"The directory {os.fspath(path)!r} holds no {_CONFIG}. Give the "
                    "config.json of the model, or the directory transformers saved it in."
                )
            path = path / _CONFIG
        where = os.fspath(path)
        config = _config_object(_read_config(path), where)
        return _from_config(config, repr(where)), where
    raise ArgumentTypeError(
        f"The model to estimate is a {type(source).__name__} {source!r:.60}; give a "
        "torch.nn.Module, a transformers config (object, config.json or its directory) or "
        "'module:callable'."
    )
