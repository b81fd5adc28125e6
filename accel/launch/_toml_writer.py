"""Writing the accel config file: flat TOML, one commented line per setting, atomically."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from accel._config_file import check_consistency
from accel._settings import SETTINGS, toml_value, validate_setting
from accel.errors import ConfigError

__all__ = ["dump_config", "write_config"]


def dump_config(settings: Mapping[str, object]) -> str:
    """Render settings as the flat TOML of a config file, one commented line each.

    Raises:
        ConfigError: a key is not a known setting.

    Example:
        >>> print(dump_config({"cpu": True}), end="")
        # accel config file (written by `accel config`); see `accel env` for resolved values.
        <BLANKLINE>
        # run on the CPU even where GPUs are available
        cpu = true
    """
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ConfigError(
            f"Cannot write unknown settings {sorted(unknown)}; the known ones are "
            f"{sorted(SETTINGS)}."
        )
    lines = ["# accel config file (written by `accel config`); see `accel env` for resolved "
             "values.", ""]
    for key in SETTINGS:
        if key in settings and settings[key] is not None:
            lines += [f"# {SETTINGS[key].help}", f"{key} = {toml_value(settings[key])}"]
    return "\n".join(lines) + "\n"


def write_config(path: str | os.PathLike[str], settings: Mapping[str, object]) -> Path:
    """Validate ``settings`` and write them to ``path`` atomically (parents created).

    Raises:
        ConfigError: a key or value is invalid.

    Example:
        >>> write_config("/tmp/accel.toml", {"mixed_precision": "bf16"})
        PosixPath('/tmp/accel.toml')
    """
    target = Path(path).expanduser()
    checked = {k: validate_setting(k, v, "settings") for k, v in settings.items()}
    check_consistency(checked, "settings")
    text = dump_config(checked)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, target)
    return target
