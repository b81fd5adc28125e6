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

A config's sizes are checked before anything is built (:func:`check_sizes`): layer counts,
widths, vocabulary, heads, positions and experts must be whole numbers within bounds far
beyond any real model, and together describe fewer than ``2**49`` parameters (so that every
byte count stays below ``2**53``, exact as a float64). Building a meta model takes time per
layer, and some models allocate real buffers (rotary frequencies, causal masks) from these
sizes, so a config with ``n_layer: 1e12`` is refused, not built.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from accel.errors import ArgumentTypeError, CheckpointError, ConfigError

__all__ = ["ModelSource", "build_model", "check_sizes"]

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


# what the number is, the smallest and largest accepted, what real models have, an example:
# bounds far beyond any real model, so that building the meta model stays quick and the real
# buffers some models build from these sizes (rotary frequencies) stay small
_LAYERS = ("a layer count", 1, 10_000, "a few hundred at most", 32)
_WIDTH = ("a width", 1, 1 << 20, "tens of thousands at most", 4096)
_HEADS = ("a head count", 1, 1 << 16, "a few hundred at most", 32)
_VOCAB = ("a vocabulary size", 1, 1 << 26, "a few hundred thousand at most", 32000)
_POSITIONS = ("a number of positions", 1, 1 << 24, "ten million at most", 4096)
_HEAD_DIM = ("a head width", 0, 1 << 20, "a few hundred at most", 128)  # 0: derived
_EXPERTS = ("a number of experts", 0, 1 << 16, "tens of thousands at most", 8)
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
               "decoder_layers", "num_encoder_layers", "num_decoder_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "embed_dim")
_INNER_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim",
               "decoder_ffn_dim", "ffn_hidden_size", "hidden_dim")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_VOCAB_KEYS = ("vocab_size", "padded_vocab_size")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                  "seq_length")
_SIZES: dict[str, tuple[str, int, int, str, int]] = {
    **dict.fromkeys(_LAYER_KEYS, _LAYERS),
    **dict.fromkeys((*_HIDDEN_KEYS, *_INNER_KEYS, "moe_intermediate_size",
                     "shared_expert_intermediate_size"), _WIDTH),
    **dict.fromkeys(("head_dim", "kv_channels", "d_kv"), _HEAD_DIM),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads",
                     "num_key_value_heads", "num_kv_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "multi_query_group_num"), _HEADS),
    **dict.fromkeys(_VOCAB_KEYS, _VOCAB),
    **dict.fromkeys(_POSITION_KEYS, _POSITIONS),
    **dict.fromkeys((*_EXPERT_KEYS, "n_shared_experts", "num_experts_per_tok"), _EXPERTS),
}
_MAX_PARAMETERS = 1 << 49  # x 16 bytes (fp32 weights, gradients, two Adam states): 2**53


def _items(value: Any) -> list[tuple[str, Any]]:
    """A size, or each of a list of sizes (one per layer) or of a mapping of sizes (one per
    part: lxmert's layers), with its label."""
    if isinstance(value, list):
        return [(f"[{i}]", item) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        return [(f".{key}", item) for key, item in value.items()]
    return [("", value)]


def _whole(value: Any) -> int | None:
    """``value`` as a whole number (an int, or a float without a fraction: some configs
    transformers writes hold ``1200.0``), else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _rough_parameters(config: Mapping[str, Any], prefix: str) -> tuple[int, list[str]]:
    """An upper estimate of the parameters the (checked) sizes of one config describe, and
    the ``key=value`` pairs it used: layers x (attention 4h^2 + MLP 3h x inner + experts x 3h
    x the expert's inner), plus the embeddings (vocabulary and positions) x h."""
    used: list[str] = []

    def largest(keys: tuple[str, ...]) -> int:
        found = [(whole, k) for k in keys for _, v in _items(config.get(k))
                 if (whole := _whole(v)) is not None]
        if not found:
            return 0
        value, key = max(found)
        used.append(f"{prefix}{key}={value}")
        return value

    hidden = largest(_HIDDEN_KEYS)
    if not hidden:
        return 0, []
    layers = sum(largest((key,)) for key in _LAYER_KEYS)
    inner = largest(_INNER_KEYS) or 4 * hidden
    experts = largest(_EXPERT_KEYS)
    expert_inner = largest(("moe_intermediate_size",)) or inner
    per_layer = 4 * hidden * hidden + 3 * hidden * (inner + experts * expert_inner)
    embeddings = (largest(_VOCAB_KEYS) + largest(_POSITION_KEYS)) * hidden
    return max(layers, 1) * per_layer + embeddings, used


def check_sizes(config: Mapping[str, Any], where: str) -> None:
    """Refuse a model config (a ``config.json``'s contents, nested configs included) whose
    sizes no real model has, before anything is built.

    Raises:
        ConfigError: a size (layers, widths, heads, vocabulary, positions, experts) that is
            not a whole number or is out of its bounds, naming the key and the value; or
            sizes that together describe over ``2**49`` parameters.

    Example:
        >>> check_sizes({"model_type": "gpt2", "n_layer": 10**12}, "config.json")
        Traceback (most recent call last):
        accel.errors.ConfigError: The model config 'config.json' gives n_layer=1000000000000...
    """
    total, parts = 0, []
    todo: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    while todo:  # nested configs (text_config, vision_config...) too, without recursion
        prefix, current = todo.pop()
        for key, value in current.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                todo.append((f"{name}.", value))
            elif isinstance(value, list):
                todo += [(f"{name}[{i}].", v) for i, v in enumerate(value)
                         if isinstance(v, Mapping)]
            bounds = _SIZES.get(str(key))
            if bounds is None or value is None:
                continue  # None: transformers' default (e.g. head_dim = hidden / heads)
            what, least, most, real, example = bounds
            for index, item in _items(value):
                whole = _whole(item)
                if whole is None or not least <= whole <= most:
                    raise ConfigError(
                        f"The model config {where!r} gives {name}{index}={item!r:.60}; "
                        f"{what} must be a whole number from {least} to {most:,} (real models "
                        f"have {real}). Fix it in the config (e.g. `\"{key}\": {example}`); "
                        "nothing was built."
                    )
        found, used = _rough_parameters(current, prefix)
        total += found
        parts += used
    if total > _MAX_PARAMETERS:
        raise ConfigError(
            f"The model config {where!r} describes about {total:.3g} parameters "
            f"({', '.join(parts[:8])}), more than 2**49 ({_MAX_PARAMETERS:.3g}): its byte "
            "counts would pass 2**53, beyond what a float64 counts exactly, and no real model "
            "comes within a hundred times that. Fix the sizes in the config (`"
            f"{parts[0].split('=')[0]}` and the others named); nothing was built."
        )


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
    check_sizes(data, where)
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
    try:
        return config_class.from_dict(dict(data))
    except Exception as exc:  # transformers' own checks of the fields (types, ranges)
        raise ConfigError(
            f"transformers refuses the model config {where!r} ({type(exc).__name__}: "
            f"{str(exc)[:600]}). Fix the config (`config.save_pretrained(dir)` writes a valid "
            "one)."
        ) from None


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
        ConfigError: a missing or unreadable config, sizes no real model has
            (:func:`check_sizes`), an unknown ``model_type``, a callable that cannot be
            imported, or transformers missing.
        ArgumentTypeError: ``source`` is none of the accepted kinds, or the callable returns
            something other than a module.

    Example:
        >>> model, where = build_model("checkpoints/config.json")
    """
    if isinstance(source, nn.Module):
        return source, type(source).__name__
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):  # a transformers config
        where = f"the {type(source).__name__}"
        data = source.to_dict()
        if isinstance(data, Mapping):
            check_sizes(data, where)
        return _from_config(source, where), type(source).__name__
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
