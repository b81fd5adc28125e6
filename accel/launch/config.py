"""The accel config file (TOML): where it lives, reading, validating, writing, asking.

Settings come from four layers, highest first: the command line, the ``ACCEL_*`` environment,
the config file, then defaults. :func:`load_config` reads the file layer;
:func:`resolve_settings` merges the layers and remembers where each value came from (what
``accel env`` shows).

The file is flat TOML, for example::

    num_machines = 1
    num_processes = 2          # in total, across all machines
    mixed_precision = "bf16"
    gradient_accumulation_steps = 4
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from accel import _ddp
from accel._env import LaunchEnv, read_launch_env
from accel.errors import AbortedError as AbortedError
from accel.errors import ConfigError, ConfigTypeError

__all__ = [
    "SETTINGS",
    "Resolved",
    "Source",
    "ask_config",
    "config_path",
    "default_config_path",
    "default_settings",
    "dump_config",
    "load_config",
    "parse_config",
    "resolve_settings",
    "validate_setting",
    "write_config",
]

Source = Literal["command line", "environment", "config file", "default"]
Kind = Literal["int", "float", "bool", "str", "choice", "table"]


@attrs.frozen
class _Spec:
    kind: Kind
    help: str
    default: object = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None


SETTINGS: Mapping[str, _Spec] = {
    # where the processes run (used by `accel launch`)
    "num_machines": _Spec("int", "machines (nodes) in the job", 1, minimum=1),
    "num_processes": _Spec(
        "int", "processes in total, across all machines (default: one per GPU, else 2)",
        minimum=1,
    ),
    "machine_rank": _Spec("int", "rank of this machine, 0 for the main one", 0, minimum=0),
    "main_process_ip": _Spec("str", "address of machine 0 (several machines)"),
    "main_process_port": _Spec(
        "int", "port on machine 0 (default: a free port on one machine, else 29500)",
        minimum=1, maximum=65535,
    ),
    "max_restarts": _Spec("int", "times the job restarts after a process fails", 0, minimum=0),
    # the run-wide policy (read by accel.distributed())
    "mixed_precision": _Spec(
        "choice", "autocast precision", "no", choices=("no", "fp16", "bf16", "fp8")
    ),
    "gradient_accumulation_steps": _Spec(
        "int", "batches per optimizer step", 1, minimum=1
    ),
    "strategy": _Spec(
        "choice", "how models are wrapped (default: ddp with several processes, else none)",
        choices=("none", "ddp", "fsdp"),
    ),
    "backend": _Spec(
        "choice", "torch.distributed backend (default: nccl on CUDA, gloo on CPU)",
        choices=("gloo", "nccl", "mpi", "ucc", "xccl", "hccl"),
    ),
    "cpu": _Spec("bool", "run on the CPU even where GPUs are available", False),
    "debug": _Spec("bool", "check every collective across ranks first (slower)", False),
    "timeout": _Spec("float", "seconds before a collective gives up", 1800.0, minimum=0.0),
    "on_each_node": _Spec(
        "bool", "each machine's first process saves its own copy (no shared filesystem)", False
    ),
    # DDP options (read by accel.prepare_model where it wraps a model in DDP)
    "find_unused_parameters": _Spec("bool", "DDP: allow parameters with no gradient", False),
    "static_graph": _Spec("bool", "DDP: the graph is the same every step", False),
    "gradient_as_bucket_view": _Spec("bool", "DDP: gradients are views of its buckets", False),
    "bucket_cap_mb": _Spec("float", "DDP: all-reduce bucket size in MB", 25.0, minimum=0.0),
    "broadcast_buffers": _Spec("bool", "DDP: copy rank 0's buffers to the others", True),
    "comm_hook": _Spec("choice", "DDP: gradient communication", "no", choices=_ddp.COMM_HOOKS),
    "comm_wrapper": _Spec("choice", "DDP: cast the hook's input", "no",
                          choices=_ddp.COMM_WRAPPERS),
    "comm_state_option": _Spec("table", "DDP: PowerSGD options (an inline table)", {}),
}
"""Every config key, its type, meaning, default (``None``: decided at run time) and limits."""

_TRUE = ("true", "yes", "y", "1", "on")
_FALSE = ("false", "no", "n", "0", "off")


def _allowed(spec: _Spec) -> str:
    if spec.kind == "choice":
        return f"one of {list(spec.choices)}"
    if spec.kind == "bool":
        return "true or false"
    if spec.kind == "str":
        return "a non-empty string"
    if spec.kind == "table":
        return "an inline table"
    low = "" if spec.minimum is None else f" >= {spec.minimum:g}"
    high = "" if spec.maximum is None else f" and <= {spec.maximum:g}"
    noun = "a whole number" if spec.kind == "int" else "a number"
    if spec.kind == "float" and spec.minimum == 0.0:
        low = " > 0"
    return f"{noun}{low}{high}"


def _example(spec: _Spec) -> str:
    if spec.kind == "table":
        return "{matrix_approximation_rank = 2}"
    if spec.default is not None:
        return _toml_value(spec.default)
    if spec.kind == "choice":
        return _toml_value(spec.choices[0])
    if spec.kind == "str":
        return '"10.0.0.1"'
    if spec.kind == "bool":
        return "true"
    return str(int(spec.minimum or 0) + 1)


def _invalid(key: str, value: object, spec: _Spec, origin: str) -> ConfigError:
    return ConfigError(
        f"{origin}: {key}={value!r} is invalid; it must be {_allowed(spec)}. "
        f"Fix it, e.g. `{key} = {_example(spec)}`, or remove it to use the default."
    )


def validate_setting(key: str, value: object, origin: str = "config") -> object:
    """Check one setting and convert text (from the environment or a prompt) to its type.

    Args:
        key: a key of :data:`SETTINGS`.
        value: the value, already typed (from TOML) or as text.
        origin: where it came from, for the error message (e.g. the file path).

    Returns:
        The value as int, float, bool, str or (``comm_state_option``) dict.

    Raises:
        ConfigError: unknown key, or a value of the wrong type or out of range; the message
            names the key, the value and the allowed values.

    Example:
        >>> validate_setting("gradient_accumulation_steps", "4")
        4
    """
    spec = SETTINGS.get(key)
    if spec is None:
        raise ConfigError(
            f"{origin}: unknown setting {key!r}; the known ones are {sorted(SETTINGS)}. "
            "Remove or rename it (`accel config` writes a valid file)."
        )
    if spec.kind == "table":
        return _ddp.check_option(key, value, origin)
    if spec.kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise _invalid(key, value, spec, origin)
    if spec.kind in ("choice", "str"):
        if not isinstance(value, str) or not value.strip():
            raise _invalid(key, value, spec, origin)
        text = value.strip()
        if spec.kind == "choice":
            text = text.lower()
            if text not in spec.choices:
                raise _invalid(key, value, spec, origin)
        return text
    number: float | int
    if isinstance(value, bool):
        raise _invalid(key, value, spec, origin)
    try:
        if spec.kind == "int":
            if isinstance(value, float):
                raise ValueError
            number = int(value) if isinstance(value, (int, str)) else int(str(value))
        else:
            number = float(value) if isinstance(value, (int, float, str)) else float(str(value))
    except ValueError:
        raise _invalid(key, value, spec, origin) from None
    if not math.isfinite(number):
        raise _invalid(key, value, spec, origin)
    if spec.minimum is not None:
        too_low = number <= spec.minimum if spec.kind == "float" else number < spec.minimum
        if too_low:
            raise _invalid(key, value, spec, origin)
    if spec.maximum is not None and number > spec.maximum:
        raise _invalid(key, value, spec, origin)
    return number


def _check_consistency(settings: Mapping[str, object], origin: str) -> None:
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
    toml = _toml_module()
    try:
        raw = toml.loads(text)
    except toml.TOMLDecodeError as error:
        raise ConfigError(
            f"{origin} is not valid TOML ({error}). Fix it or rewrite it with `accel config`."
        ) from None
    settings = {key: validate_setting(key, value, origin) for key, value in raw.items()}
    _check_consistency(settings, origin)
    return settings


def _toml_module() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise ConfigError(
            "Reading the accel config file on Python 3.10 needs the `tomli` package. "
            "Install it with `pip install tomli`."
        ) from None
    return tomli


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """The user config file: ``$XDG_CONFIG_HOME/accel/config.toml`` or ``~/.config/...``.

    Example:
        >>> default_config_path({"XDG_CONFIG_HOME": "/cfg"})
        PosixPath('/cfg/accel/config.toml')
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if base.strip() else Path.home() / ".config"
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


@attrs.frozen
class Resolved:
    """One resolved setting: its value (``None``: decided at run time) and its source."""

    value: object
    source: Source


def _env_layer(env: LaunchEnv) -> dict[str, object]:
    names = ("mixed_precision", "gradient_accumulation_steps", "strategy", "backend", "cpu",
             "debug", "timeout", "on_each_node")
    return {name: getattr(env, name) for name in names if getattr(env, name) is not None}


def resolve_settings(
    command_line: Mapping[str, object],
    env: LaunchEnv,
    file: Mapping[str, object],
) -> dict[str, Resolved]:
    """Merge the layers: command line > environment (``ACCEL_*``) > config file > defaults.

    Args:
        command_line: settings given as options (``None`` values are ignored).
        env: the launch environment; its ``ACCEL_*`` options form the environment layer.
        file: the config file's settings (from :func:`load_config`).

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
                origin = {"command line": "command line", "environment": "ACCEL_ environment",
                          "config file": "config file"}[source]
                resolved[key] = Resolved(validate_setting(key, value, origin), source)
                break
        else:
            resolved[key] = Resolved(spec.default, "default")
    _check_consistency({k: r.value for k, r in resolved.items()}, "settings")
    return resolved


def default_settings() -> dict[str, object]:
    """The settings ``accel config --default`` writes (those with a fixed default).

    Example:
        >>> default_settings()["mixed_precision"]
        'no'
    """
    return {key: spec.default for key, spec in SETTINGS.items() if spec.default is not None}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        for code in (*range(0x20), 0x7F):
            escaped = escaped.replace(chr(code), f"\\u{code:04X}")
        return f'"{escaped}"'
    raise ConfigTypeError(f"cannot write {value!r} to the flat accel config file")


def dump_config(settings: Mapping[str, object]) -> str:
    """Render settings as the flat TOML of a config file, one commented line each.

    Example:
        >>> print(dump_config({"cpu": True}), end="")
        # accel config file (written by `accel config`); see `accel env` for resolved values.
        <BLANKLINE>
        # run on the CPU even where GPUs are available
        cpu = true
    """
    lines = ["# accel config file (written by `accel config`); see `accel env` for resolved "
             "values.", ""]
    for key in SETTINGS:
        if key in settings and settings[key] is not None:
            lines += [f"# {SETTINGS[key].help}", f"{key} = {_toml_value(settings[key])}"]
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ConfigError(
            f"Cannot write unknown settings {sorted(unknown)}; the known ones are "
            f"{sorted(SETTINGS)}."
        )
    return "\n".join(lines) + "\n"


def write_config(path: str | os.PathLike[str], settings: Mapping[str, object]) -> Path:
    """Validate ``settings`` and write them to ``path`` atomically (parents created).

    Example:
        >>> write_config("/tmp/accel.toml", {"mixed_precision": "bf16"})
        PosixPath('/tmp/accel.toml')
    """
    target = Path(path).expanduser()
    checked = {k: validate_setting(k, v, "settings") for k, v in settings.items()}
    _check_consistency(checked, "settings")
    text = dump_config(checked)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, target)
    return target


def _ask(
    key: str,
    question: str,
    default: str,
    read: Callable[[str], str],
    say: Callable[[str], None],
    extra: Callable[[object], str | None] | None = None,
) -> object:
    """Ask until the answer is valid; an empty answer takes ``default`` ("": leave unset)."""
    while True:
        try:
            answer = read(f"{question} [{default or 'auto'}]: ").strip()
        except EOFError:
            raise AbortedError("accel config: input ended; nothing was written.") from None
        if not answer:
            if not default:
                return None
            answer = default
        if not default and answer.lower() == "auto":
            return None
        try:
            value = validate_setting(key, answer, "answer")
        except ConfigError:
            say(f"  {answer!r} is not valid for {key}: it must be {_allowed(SETTINGS[key])}. "
                "Try again.")
            continue
        problem = extra(value) if extra is not None else None
        if problem:
            say(f"  {problem} Try again.")
            continue
        return value


def ask_config(
    read: Callable[[str], str] = input,
    say: Callable[[str], None] = print,
) -> dict[str, object]:
    """The ``accel config`` questionnaire: ask a few questions, re-asking on bad answers.

    Args:
        read: shows a prompt and returns the answer (``input`` by default).
        say: prints a message (``print`` by default).

    Returns:
        The chosen settings (automatic ones left out), ready for :func:`write_config`.

    Raises:
        AbortedError: the input ended (EOF) before the last question.

    Example:
        >>> answers = iter(["1", "", "n", "bf16", "2", "", "0", "n"])
        >>> ask_config(lambda prompt: next(answers), lambda text: None)["mixed_precision"]
        'bf16'
    """
    out: dict[str, object] = {}
    machines = _ask("num_machines", "How many machines (nodes) will the job use?", "1",
                    read, say)
    out["num_machines"] = machines
    machines = machines if isinstance(machines, int) else 1
    if machines > 1:
        out["machine_rank"] = _ask(
            "machine_rank", "Rank of this machine (0 for the main one)?", "0", read, say,
            lambda r: None if isinstance(r, int) and r < machines
            else f"The rank must be below {machines}.",
        )
        out["main_process_ip"] = _ask(
            "main_process_ip", "IP address or host name of machine 0?", "127.0.0.1", read, say
        )
        out["main_process_port"] = _ask(
            "main_process_port", "Port on machine 0?", "29500", read, say
        )
    out["num_processes"] = _ask(
        "num_processes",
        "How many processes in total, across all machines? ('auto': one per GPU, else 2)",
        "", read, say,
        lambda n: None if isinstance(n, int) and n % machines == 0
        else f"It must be a multiple of the {machines} machines.",
    )
    out["cpu"] = _ask("cpu", "Run on the CPU only, even where GPUs are available? (y/n)",
                      "n", read, say)
    out["mixed_precision"] = _ask("mixed_precision", "Mixed precision? (no/fp16/bf16/fp8)",
                                  "no", read, say)
    out["gradient_accumulation_steps"] = _ask(
        "gradient_accumulation_steps", "Gradient accumulation steps?", "1", read, say
    )
    out["strategy"] = _ask(
        "strategy", "Strategy? (ddp/fsdp/none; 'auto': ddp with several processes)", "",
        read, say,
    )
    out["max_restarts"] = _ask(
        "max_restarts", "How many times may the job restart after a process fails?", "0",
        read, say,
    )
    out["debug"] = _ask("debug", "Debug mode: check every collective across ranks? (y/n)",
                        "n", read, say)
    return {key: value for key, value in out.items() if value is not None}
