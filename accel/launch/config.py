"""The accel settings as ``accel launch``, ``accel config`` and ``accel env`` see them.

Settings come from four layers, highest first: the command line, the ``ACCEL_*`` environment,
the config file, then defaults. :func:`resolve_settings` merges the layers and remembers where
each value came from (what ``accel env`` shows).

The keys, kinds and checks are in :mod:`accel.core.settings`; reading the file is in
:mod:`accel.core.config_file`, and writing it (below ``accel.distributed()``, which reads it too);
the questionnaire in :mod:`accel.cli.questionnaire`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

from accel.core.config_file import check_consistency
from accel.core.env import LaunchEnv
from accel.core.setting_values import validate_setting
from accel.core.settings import POLICY_KEYS, SETTINGS

__all__ = ["Resolved", "Source", "default_settings", "resolve_settings"]

Source = Literal["command line", "environment", "config file", "default"]

_ORIGINS: Mapping[Source, str] = {
    "command line": "command line",
    "environment": "ACCEL_ environment",
    "config file": "config file",
    "default": "default",
}


@attrs.frozen
class Resolved:
    """One resolved setting: its value (``None``: decided at run time) and its source."""

    value: object
    source: Source


def _env_layer(env: LaunchEnv) -> dict[str, object]:
    return {key: getattr(env, key) for key in POLICY_KEYS if getattr(env, key) is not None}


def resolve_settings(
    command_line: Mapping[str, object],
    env: LaunchEnv,
    file: Mapping[str, object],
) -> dict[str, Resolved]:
    """Merge the layers: command line > environment (``ACCEL_*``) > config file > defaults.

    Args:
        command_line: settings given as options (``None`` values are ignored).
        env: the launch environment; its ``ACCEL_*`` options form the environment layer.
        file: the config file's settings (from :func:`accel.core.config_file.load_config`).

    Returns:
        Every key of :data:`SETTINGS` with its value and the layer it came from.

    Raises:
        ConfigError: a value is invalid, or the merged machine/process counts disagree.

    Example:
        >>> r = resolve_settings({"mixed_precision": "fp16"}, LaunchEnv(), {})
        >>> r["mixed_precision"], r["debug"]
        (Resolved(value='fp16', source='command line'), Resolved(value=False, source='default'))
    """
    layers: list[tuple[Source, Mapping[str, object]]] = [
        ("command line", command_line),
        ("environment", _env_layer(env)),
        ("config file", file),
    ]
    resolved: dict[str, Resolved] = {}
    for key, spec in SETTINGS.items():
        for source, layer in layers:
            value = layer.get(key)
            if value is not None:
                resolved[key] = Resolved(validate_setting(key, value, _ORIGINS[source]), source)
                break
        else:
            resolved[key] = Resolved(spec.default, "default")
    check_consistency({k: r.value for k, r in resolved.items()}, "settings")
    return resolved


def default_settings() -> dict[str, object]:
    """The settings ``accel config --default`` writes (those with a fixed default).

    Example:
        >>> default_settings()["mixed_precision"]
        'no'
    """
    return {key: spec.default for key, spec in SETTINGS.items() if spec.default is not None}
