"""The ``accel config`` questionnaire: a few questions, re-asked until the answer is valid."""

from __future__ import annotations

from collections.abc import Callable

from accel.core.setting_values import allowed, validate_setting
from accel.core.settings import DEFAULT_CPU_PROCESSES, DEFAULT_PORT, MIXED_PRECISION_MODES, SETTINGS
from accel.errors import AbortedError, ConfigError

__all__ = ["ask_config"]

_OFFERED_PRECISION = MIXED_PRECISION_MODES  # fp8: torchao's float8 training (accel[fp8])


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
            say(f"  {answer!r} is not valid for {key}: it must be {allowed(SETTINGS[key])}. "
                "Try again.")
            continue
        problem = extra(value) if extra is not None else None
        if problem:
            say(f"  {problem} Try again.")
            continue
        return value


def _offered_precision(value: object) -> str | None:
    if value in _OFFERED_PRECISION:
        return None
    return f"{value!r} is not offered; choose one of {'/'.join(_OFFERED_PRECISION)}."


def ask_config(
    read: Callable[[str], str] = input,
    say: Callable[[str], None] = print,
) -> dict[str, object]:
    """The ``accel config`` questionnaire: ask a few questions, re-asking on bad answers.

    Args:
        read: shows a prompt and returns the answer (``input`` by default).
        say: prints a message (``print`` by default).

    Returns:
        The chosen settings (automatic ones left out), ready for ``write_config``.

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
            "main_process_port", "Port on machine 0?", str(DEFAULT_PORT), read, say
        )
    out["num_processes"] = _ask(
        "num_processes",
        "How many processes in total, across all machines? ('auto': one per GPU, else "
        f"{DEFAULT_CPU_PROCESSES})",
        "", read, say,
        lambda n: None if isinstance(n, int) and n % machines == 0
        else f"It must be a multiple of the {machines} machines.",
    )
    out["cpu"] = _ask("cpu", "Run on the CPU only, even where GPUs are available? (y/n)",
                      "n", read, say)
    out["mixed_precision"] = _ask(
        "mixed_precision", f"Mixed precision? ({'/'.join(_OFFERED_PRECISION)})", "no",
        read, say, _offered_precision,
    )
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
