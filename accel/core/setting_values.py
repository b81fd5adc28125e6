"""A setting's value checked against its definition, converted, described and written.

:func:`validate_setting` checks one value (typed, or text from the environment or a prompt)
against its :class:`~accel.core.settings.Spec` and converts it to its kind;
:func:`check_power_sgd_options` checks ``comm_state_option``'s table; :func:`allowed` says in
words what a setting accepts and :func:`toml_value` writes a value as the config file holds it.
The environment, the config file, ``distributed()``, ``accel launch`` and ``accel config`` all
check with these, so an error reads the same wherever the value came from. This module imports
nothing from accel but :mod:`accel.core.settings` and :mod:`accel.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from accel.core.settings import (
    FALSE_WORDS,
    POWER_SGD_OPTIONS,
    SETTINGS,
    TRUE_WORDS,
    Spec,
    did_you_mean,
    parse_bool,
)
from accel.errors import ConfigError, ConfigTypeError

__all__ = ["allowed", "check_power_sgd_options", "toml_value", "validate_setting"]


def check_power_sgd_options(value: object, origin: str) -> dict[str, Any]:
    """Check a ``comm_state_option`` table (PowerSGD options) and return it as a dict.

    Raises:
        ConfigError: not a mapping, an unknown key, or a value of the wrong type or range.

    Example:
        >>> check_power_sgd_options({"matrix_approximation_rank": 2}, "config")
        {'matrix_approximation_rank': 2}
    """
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{origin}: DDP option comm_state_option={value!r} is invalid; it must be a dict "
            f"of PowerSGD options (keys among {sorted(POWER_SGD_OPTIONS)}), e.g. "
            "`accel.prepare_model(model, comm_state_option={'matrix_approximation_rank': 2})`."
        )
    out: dict[str, Any] = {}
    for name, item in value.items():
        spec = POWER_SGD_OPTIONS.get(name) if isinstance(name, str) else None
        if spec is None:
            hint = did_you_mean(str(name), POWER_SGD_OPTIONS)
            raise ConfigError(
                f"{origin}: comm_state_option has the unknown PowerSGD option {name!r}{hint}; "
                f"the known ones are {sorted(POWER_SGD_OPTIONS)}, e.g. "
                "`comm_state_option={'matrix_approximation_rank': 2}`."
            )
        kind, minimum = spec
        ok = isinstance(item, bool) if kind is bool else (
            isinstance(item, (int, float) if kind is float else int)
            and not isinstance(item, bool)
            and math.isfinite(item)
            and item >= minimum
        )
        if not ok:
            noun = {bool: "True or False", int: f"a whole number >= {minimum}",
                    float: f"a number >= {minimum}"}[kind]
            example = {bool: "True", int: "2", float: "2.0"}[kind]
            raise ConfigError(
                f"{origin}: comm_state_option[{name!r}]={item!r} is invalid; it must be {noun}, "
                f"e.g. `comm_state_option={{{name!r}: {example}}}`."
            )
        out[name] = item
    if out.get("start_powerSGD_iter", 1000) <= 1 and (
        out.get("use_error_feedback", True) or out.get("warm_start", True)
    ):
        raise ConfigError(
            f"{origin}: comm_state_option['start_powerSGD_iter']={out['start_powerSGD_iter']!r} "
            "must be > 1 while use_error_feedback or warm_start is on (PowerSGD starts after "
            "DDP's first two iterations). Use e.g. `{'start_powerSGD_iter': 2}`, or turn "
            "both off: `{'use_error_feedback': False, 'warm_start': False}`."
        )
    return out


def allowed(spec: Spec) -> str:
    """The values a setting accepts, in words (for messages and prompts).

    Example:
        >>> allowed(SETTINGS["cpu"])
        'true or false (also 1/0, yes/no, y/n, on/off)'
    """
    if spec.kind == "choice":
        return f"one of {list(spec.choices)}"
    if spec.kind == "bool":
        pairs = ", ".join(f"{t}/{f}" for t, f in zip(TRUE_WORDS, FALSE_WORDS, strict=True)
                          if t != "true")
        return f"true or false (also {pairs})"
    if spec.kind == "str":
        return "a non-empty string"
    if spec.kind == "table":
        return "an inline table"
    if spec.kind == "blocks":
        return "true or false, or module class names separated by commas"
    low = "" if spec.minimum is None else f" >= {spec.minimum:g}"
    high = "" if spec.maximum is None else f" and <= {spec.maximum:g}"
    noun = "a whole number" if spec.kind == "int" else "a number"
    if spec.kind == "float" and spec.minimum == 0.0:
        low = " > 0"
    return f"{noun}{low}{high}"


def toml_value(value: object) -> str:
    """``value`` as a TOML literal (bool, int, float, str or a flat inline table).

    Raises:
        ConfigError: a value the flat config file cannot hold.

    Example:
        >>> toml_value(True), toml_value("bf16")
        ('true', '"bf16"')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        for code in (*range(0x20), 0x7F):
            escaped = escaped.replace(chr(code), f"\\u{code:04X}")
        return f'"{escaped}"'
    raise ConfigTypeError(
        f"Cannot write {value!r} (a {type(value).__name__}) to the flat accel config file; a "
        "setting is a bool, a number, a string or (comm_state_option) an inline table."
    )


def _example(spec: Spec) -> object:
    if spec.kind == "table":
        return {"matrix_approximation_rank": 2}
    if spec.kind == "blocks":
        return True
    if spec.default is not None:
        return spec.default
    if spec.kind == "choice":
        return spec.choices[0]
    if spec.kind == "str":
        return "10.0.0.1"
    if spec.kind == "bool":
        return True
    return int(spec.minimum or 0) + 1


def _invalid(key: str, value: object, spec: Spec, origin: str, variable: str | None) -> ConfigError:
    example = _example(spec)
    if variable is not None:
        text = "1" if isinstance(example, bool) else str(example)
        return ConfigError(
            f"Environment variable {variable}={value!r} is invalid; {key} must be "
            f"{allowed(spec)}. Unset it or set e.g. `{variable}={text}`."
        )
    return ConfigError(
        f"{origin}: {key}={value!r} is invalid; it must be {allowed(spec)}. "
        f"Fix it, e.g. `{key} = {toml_value(example)}`, or remove it to use the default."
    )


def validate_setting(
    key: str, value: object, origin: str = "config", *, variable: str | None = None
) -> object:
    """Check one setting and convert text (from the environment or a prompt) to its kind.

    Args:
        key: a key of :data:`~accel.core.settings.SETTINGS`.
        value: the value, already typed (from TOML or Python) or as text.
        origin: where it came from, for the error message (e.g. the file path).
        variable: the environment variable it came from; phrases the error for it.

    Returns:
        The value as int, float, bool, str or (``comm_state_option``) dict; a ``"blocks"``
        setting gives a bool or its class names as one comma-separated string.

    Raises:
        ConfigError: unknown key, or a value of the wrong kind or out of range; the message
            names the key, the value and the allowed values.

    Example:
        >>> validate_setting("gradient_accumulation_steps", "4")
        4
    """
    spec = SETTINGS.get(key)
    if spec is None:
        raise ConfigError(
            f"{origin}: unknown setting {key!r}{did_you_mean(key, SETTINGS)}; the known ones "
            f"are {sorted(SETTINGS)}. "
            "Remove or rename it (`accel config` writes a valid file)."
        )
    if spec.kind == "table":
        return check_power_sgd_options(value, origin)
    if spec.kind == "blocks":
        return _blocks(key, value, spec, origin, variable)
    if spec.kind == "bool":
        if isinstance(value, bool):
            return value
        parsed = parse_bool(value) if isinstance(value, str) else None
        if parsed is None:
            raise _invalid(key, value, spec, origin, variable)
        return parsed
    if spec.kind in ("choice", "str"):
        if not isinstance(value, str) or not value.strip():
            raise _invalid(key, value, spec, origin, variable)
        text = value.strip()
        if spec.kind == "choice":
            text = text.lower()
            if text not in spec.choices:
                raise _invalid(key, value, spec, origin, variable)
        return text
    return _number(key, value, spec, origin, variable)


def _blocks(key: str, value: object, spec: Spec, origin: str, variable: str | None) -> object:
    """A boolean spelling, or class names separated by commas (``"GPT2Block, MLP"``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        parsed = parse_bool(value)
        if parsed is not None:
            return parsed
        names = [name.strip() for name in value.split(",")]
        if all(name.isidentifier() for name in names):
            return ", ".join(names)
    raise _invalid(key, value, spec, origin, variable)


def _number(key: str, value: object, spec: Spec, origin: str, variable: str | None) -> float:
    number: float
    if isinstance(value, bool):
        raise _invalid(key, value, spec, origin, variable)
    if spec.kind == "int" and isinstance(value, float):
        raise _invalid(key, value, spec, origin, variable)
    try:
        if spec.kind == "int":
            number = int(value.strip()) if isinstance(value, str) else int(str(value))
        else:
            number = float(value) if isinstance(value, (int, float, str)) else float(str(value))
    except ValueError:
        raise _invalid(key, value, spec, origin, variable) from None
    if not math.isfinite(number):
        raise _invalid(key, value, spec, origin, variable)
    if spec.minimum is not None:
        too_low = number <= spec.minimum if spec.kind == "float" else number < spec.minimum
        if too_low:
            raise _invalid(key, value, spec, origin, variable)
    if spec.maximum is not None and number > spec.maximum:
        raise _invalid(key, value, spec, origin, variable)
    return number
