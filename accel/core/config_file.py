"""The accel config file (TOML): where it lives, reading, checking and writing it.

This is the file layer of the settings, below ``accel.distributed()`` (which fills what the
environment leaves unset from it) and below ``accel launch`` / ``accel env``
(:mod:`accel.launch.config` merges the layers). Keys, kinds and checks come from
:data:`accel.core.settings.SETTINGS`. The file is flat TOML, for example::

    num_machines = 1
    num_processes = 2          # in total, across all machines
    mixed_precision = "bf16"
    gradient_accumulation_steps = 4

Also here: :func:`deepspeed_policy`, what a DeepSpeed config file says of the same two
settings (read where nothing else sets them, under ``strategy="deepspeed"``), and
:func:`load_deepspeed_json`, the one bounded reader of a DeepSpeed JSON file (the engine's too).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel.core.env import LaunchEnv, read_launch_env, read_variable
from accel.core.setting_values import toml_value, validate_setting
from accel.core.settings import SETTINGS
from accel.core.strict_json import parse_json
from accel.errors import ConfigError

__all__ = [
    "check_consistency",
    "config_path",
    "DEEPSPEED_CONFIG_MAX_BYTES",
    "DEEPSPEED_CONFIG_MAX_DEPTH",
    "deepspeed_policy",
    "default_config_path",
    "dump_config",
    "load_config",
    "load_deepspeed_json",
    "parse_config",
    "write_config",
]


def check_consistency(settings: Mapping[str, object], origin: str) -> None:
    """Check the settings that depend on each other (machine and process counts).

    Raises:
        ConfigError: ``num_processes`` is not a multiple of ``num_machines``, or
            ``machine_rank`` is not below ``num_machines``.

    Example:
        >>> check_consistency({"num_machines": 2, "num_processes": 4}, "config")
    """
    machines = settings.get("num_machines")
    total = settings.get("num_processes")
    if isinstance(machines, int) and isinstance(total, int) and total % machines:
        raise ConfigError(
            f"{origin}: num_processes={total!r} (in total) is not a multiple of "
            f"num_machines={machines!r}; every machine runs the same number of processes. "
            f"Use e.g. `num_processes = {machines * max(1, total // machines)}`."
        )
    rank = settings.get("machine_rank")
    if isinstance(machines, int) and isinstance(rank, int) and rank >= machines:
        raise ConfigError(
            f"{origin}: machine_rank={rank!r} must be below num_machines={machines!r}. "
            f"Use `machine_rank = 0` … `{machines - 1}`."
        )


def parse_config(text: str, origin: str = "config") -> dict[str, object]:
    """Parse and validate the text of a config file.

    Args:
        text: TOML text with flat ``key = value`` lines.
        origin: named in error messages (usually the file path).

    Returns:
        The settings present in the text, typed.

    Raises:
        ConfigError: invalid TOML, unknown key or invalid value.

    Example:
        >>> parse_config('mixed_precision = "bf16"')
        {'mixed_precision': 'bf16'}
    """
    import tomllib  # imported on first read: most runs have no config file

    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(
            f"{origin} is not valid TOML ({error}). Fix it or rewrite it with `accel config`."
        ) from None
    settings = {key: validate_setting(key, value, origin) for key, value in raw.items()}
    check_consistency(settings, origin)
    return settings


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """The user config file: ``$XDG_CONFIG_HOME/accel/config.toml`` or ``~/.config/...``.

    Example:
        >>> default_config_path({"XDG_CONFIG_HOME": "/cfg"})
        PosixPath('/cfg/accel/config.toml')
    """
    base = read_variable("XDG_CONFIG_HOME", environ)
    root = Path(base) if base else Path.home() / ".config"
    return root / "accel" / "config.toml"


def config_path(
    explicit: str | os.PathLike[str] | None = None,
    *,
    env: LaunchEnv | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Path, str]:
    """Which config file applies, and why: explicit > ``$ACCEL_CONFIG_FILE`` > user dir.

    Args:
        explicit: a path given on the command line (``--config-file``).
        env: the launch environment (read from ``os.environ`` when not given).
        environ: mapping used for ``XDG_CONFIG_HOME`` (``os.environ`` when not given).

    Returns:
        The path and a short description of where it was chosen.

    Example:
        >>> config_path("my.toml")
        (PosixPath('my.toml'), '--config-file')
    """
    if explicit is not None and str(explicit).strip():
        return Path(explicit).expanduser(), "--config-file"
    launch_env = read_launch_env() if env is None else env
    if launch_env.config_file:
        return Path(launch_env.config_file).expanduser(), "$ACCEL_CONFIG_FILE"
    return default_config_path(environ), "user config dir"


def load_config(path: str | os.PathLike[str] | None = None) -> dict[str, object]:
    """Read and validate the config file; ``{}`` when there is none.

    ``path=None`` uses ``$ACCEL_CONFIG_FILE``, else the user config dir
    (``$XDG_CONFIG_HOME/accel/config.toml``, default ``~/.config/accel/config.toml``), and a
    missing user file is simply no config. A file named explicitly (argument or
    ``$ACCEL_CONFIG_FILE``) must exist.

    Args:
        path: the config file, or ``None`` to find it.

    Returns:
        The settings the file sets, typed: keys among ``num_machines``, ``num_processes``
        (total), ``machine_rank``, ``main_process_ip``, ``main_process_port``,
        ``max_restarts``, ``mixed_precision``, ``gradient_accumulation_steps``, ``strategy``,
        ``backend``, ``cpu``, ``debug``, ``timeout``, ``on_each_node`` and the DDP options.

    Raises:
        ConfigError: the named file is missing, unreadable or not UTF-8 text, or a key or
            value is invalid.

    Example:
        >>> load_config()  # no file
        {}
    """
    if path is None:
        file, how = config_path()
        required = how != "user config dir"
    else:
        file, required = Path(path).expanduser(), True
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        if not required:
            return {}
        raise ConfigError(
            f"The config file {str(file)!r} does not exist. Create it with "
            f"`accel config --config-file {file}`, or unset ACCEL_CONFIG_FILE / drop "
            "--config-file to use the user config."
        ) from None
    except OSError as error:
        raise ConfigError(
            f"Cannot read the config file {str(file)!r} ({error}). Check its permissions."
        ) from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"The config file {str(file)!r} is not UTF-8 text: byte "
            f"{error.object[error.start:error.start + 1]!r} at offset {error.start} cannot be "
            "decoded. A TOML config file must be UTF-8; save it as UTF-8 or rewrite it with "
            f"`accel config --config-file {file}`."
        ) from None
    return parse_config(text, origin=str(file))


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


#: The largest DeepSpeed JSON config accel reads (DeepSpeed's own templates are a few KB).
DEEPSPEED_CONFIG_MAX_BYTES = 4 << 20
#: The deepest nesting of arrays and objects accel reads in one (DeepSpeed's nest 3-4 deep).
DEEPSPEED_CONFIG_MAX_DEPTH = 64
_DS_EXAMPLE = "`accel.distributed(strategy='deepspeed', deepspeed_config='ds_config.json')`"
_DS_OBJECT = "`{\"zero_optimization\": {\"stage\": 2}}`"
_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_file(where: str, found: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(found.st_mode):
        kind = next((name for test, name in _KINDS if test(found.st_mode)), "not a regular file")
        raise ConfigError(
            f"deepspeed_config={where!r} is {kind}, not a regular file; accel reads the "
            f"DeepSpeed config only from a regular JSON file, e.g. {_DS_EXAMPLE}."
        )
    if found.st_size > limit:
        raise _too_large(where, limit)


def _too_large(where: str, limit: int) -> ConfigError:
    return ConfigError(
        f"deepspeed_config={where!r} holds more than {limit} bytes, the most accel reads for "
        "a DeepSpeed config (DeepSpeed's own are a few KB): it is not a DeepSpeed config. "
        f"Give the path of your DeepSpeed JSON config, e.g. {_DS_EXAMPLE}."
    )


def _read_regular(where: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``where``, never opening anything else."""
    _check_file(where, os.stat(where), limit)  # follows a link: the user's file may be one
    # O_NONBLOCK: a FIFO swapped in after the stat cannot block the open
    fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check_file(where, os.fstat(fd), limit)
        parts, size = [], 0
        while size <= limit and (part := os.read(fd, limit + 1 - size)):
            parts.append(part)
            size += len(part)
    finally:
        os.close(fd)
    if size > limit:  # it grew while read
        raise _too_large(where, limit)
    return b"".join(parts)


def _refused(where: str, what: str) -> ConfigError:
    return ConfigError(
        f"deepspeed_config={where!r} is not a valid DeepSpeed JSON config: {what}. Fix "
        f"the file; a DeepSpeed config is one JSON object, e.g. {_DS_OBJECT}."
    )


def load_deepspeed_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed JSON config file, read as untrusted input.

    Only a regular file is opened (checked with ``stat`` first, and again on the descriptor,
    opened without blocking: a FIFO or ``/dev/zero`` is refused unread), at most
    :data:`DEEPSPEED_CONFIG_MAX_BYTES` bytes are read, and the text must be UTF-8 JSON holding
    one object (``accel.core.strict_json.parse_json``: bounded nesting, no key twice, no
    ``NaN``). The engine (``accel.parallel.deepspeed.config``) and :func:`deepspeed_policy`
    both read through it.

    Raises:
        ConfigError: what is wrong with the file, naming it.

    Example:
        >>> load_deepspeed_json("ds_config.json")
        {'zero_optimization': {'stage': 2}}
    """
    where = os.fspath(Path(path).expanduser())
    try:
        data = _read_regular(where, DEEPSPEED_CONFIG_MAX_BYTES)
    except OSError as exc:
        raise ConfigError(
            f"deepspeed_config={where!r} cannot be read ({exc.strerror or exc}); give the "
            f"path of your DeepSpeed JSON config, e.g. {_DS_EXAMPLE}."
        ) from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"deepspeed_config={where!r} is not UTF-8 text: byte "
            f"{data[exc.start:exc.start + 1]!r} at offset {exc.start} cannot be decoded. A "
            "DeepSpeed config is UTF-8 JSON; save it as UTF-8."
        ) from None
    config = parse_json(
        data, lambda what: _refused(where, what), max_depth=DEEPSPEED_CONFIG_MAX_DEPTH
    )
    if not isinstance(config, dict):
        raise ConfigError(
            f"deepspeed_config={where!r} holds a {type(config).__name__}, not a JSON "
            f"object (e.g. {_DS_OBJECT})."
        )
    return config


def deepspeed_policy(source: object) -> dict[str, object]:
    """What a DeepSpeed config (a dict, or a JSON file's path) says of accel's own policy:
    ``mixed_precision`` when exactly one of its ``bf16``/``fp16`` sections is enabled with
    ``true``, ``gradient_accumulation_steps`` when it writes a number. ``accel.distributed``
    takes them when neither its arguments nor the environment or config file give them (as
    Accelerate reads them from a DeepSpeed config). The file is read by
    :func:`load_deepspeed_json` (bounded, regular files only); anything unreadable gives
    nothing here: the engine reads the config again and says what is wrong with it.

    Example:
        >>> deepspeed_policy({"bf16": {"enabled": True}, "gradient_accumulation_steps": 4})
        {'mixed_precision': 'bf16', 'gradient_accumulation_steps': 4}
    """
    config: object = source
    if isinstance(source, str | os.PathLike):
        try:
            config = load_deepspeed_json(source)
        except ConfigError:
            return {}
    if not isinstance(config, Mapping):
        return {}
    out: dict[str, object] = {}
    enabled = [key for key in ("bf16", "fp16")
               if isinstance(config.get(key), Mapping) and config[key].get("enabled") is True]
    if len(enabled) == 1:
        out["mixed_precision"] = enabled[0]
    steps = config.get("gradient_accumulation_steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        out["gradient_accumulation_steps"] = steps
    return out
