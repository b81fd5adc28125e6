"""The ``accel`` command: ``accel launch | config | env | test`` and the toolbox commands
(``estimate-memory``, ``merge-weights``, ``checkpoint``, ``config import``: see
:mod:`accel.cli.commands`).

``python -m accel.cli`` is the same command; there the subcommand may be left out
(``python -m accel.cli train.py`` means ``accel launch train.py``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from accel.errors import AccelError

__all__ = ["build_parser", "exit_process", "main", "script_main"]

_COMMANDS = ("launch", "config", "env", "test", "estimate-memory", "merge-weights", "checkpoint")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``accel`` command and its subcommands.

    Example:
        >>> build_parser().parse_args(["env", "--json"]).command
        'env'
    """
    from accel.cli.commands import add_commands, add_config_import
    from accel.launch.run import add_launch_options

    parser = argparse.ArgumentParser(
        prog="accel", description="Launch and configure distributed PyTorch training.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    launch = commands.add_parser(
        "launch", allow_abbrev=False, help="run a script on N processes / machines",
        description="Run a training script on every process (via torch's elastic launcher). "
                    "Options come from the command line, then ACCEL_* variables, then the "
                    "config file, then defaults.",
    )
    add_launch_options(launch)
    launch.add_argument("-m", "--module", action="store_true",
                        help="the target is a module name (python -m)")
    launch.add_argument("--no-python", "--no_python", action="store_true",
                        help="the target is an executable, not a Python script")
    launch.add_argument("--dry-run", action="store_true",
                        help="print the torchrun arguments and worker variables, run nothing")
    launch.add_argument("script", help="the training script (or module with -m)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments for the script")

    config = commands.add_parser(
        "config", allow_abbrev=False, help="write the config file (asks a few questions)",
        description="Ask a few questions and write the accel config file (TOML).",
    )
    config.add_argument("--default", action="store_true",
                        help="write the defaults without asking")
    config.add_argument("--config-file", "--config_file", metavar="F",
                        help="where to write (default: $ACCEL_CONFIG_FILE, else "
                             "~/.config/accel/config.toml)")
    config.add_argument("--force", action="store_true",
                        help="with --default: overwrite an existing file")
    add_config_import(config)

    env = commands.add_parser(
        "env", allow_abbrev=False, help="versions, devices, config and resolved settings",
        description="Show versions, devices, the config file and every setting with the "
                    "layer it comes from (options given here count as the command line).",
    )
    add_launch_options(env)
    env.add_argument("--json", action="store_true", help="print JSON instead of text")

    test = commands.add_parser(
        "test", allow_abbrev=False, help="run the built-in distributed self-check",
        description="Launch the built-in self-check (collectives, training steps, checkpoint) "
                    "on the configured processes and print PASS or FAIL.",
    )
    add_launch_options(test)
    add_commands(commands)
    return parser


def _config(ns: argparse.Namespace) -> int:
    from accel.cli.questionnaire import ask_config
    from accel.core.config_file import config_path, write_config
    from accel.errors import AbortedError
    from accel.launch.config import default_settings

    path, _ = config_path(ns.config_file)
    if ns.default:
        if path.exists() and not ns.force:
            print(f"accel config: {path} already exists; not overwritten. Use "
                  "`accel config --default --force` to replace it.", file=sys.stderr)
            return 1
        settings = default_settings()
    else:
        print(f"accel config: writing {path} (press Enter to accept [the default]).")
        try:
            settings = ask_config()
        except (AbortedError, KeyboardInterrupt):
            print("\naccel config: stopped; nothing was written.", file=sys.stderr)
            return 1
    written = write_config(path, settings)
    print(f"accel config: wrote {written}")
    return 0


def _env(ns: argparse.Namespace) -> int:
    from accel.cli.envinfo import collect_env_info, format_env_info
    from accel.core.config_file import config_path, load_config
    from accel.core.env import read_launch_env
    from accel.launch.config import resolve_settings
    from accel.launch.run import command_line_settings

    launch_env = read_launch_env()
    path, how = config_path(ns.config_file, env=launch_env)
    file_settings = load_config(path if how != "user config dir" else None)
    settings = resolve_settings(command_line_settings(ns), launch_env, file_settings)
    info = collect_env_info(settings, path, how)
    print(json.dumps(info, indent=2) if ns.json else format_env_info(info))
    return 0


def _test(ns: argparse.Namespace) -> int:
    from accel.launch.run import make_plan, run_plan

    # the self-check is a script the workers run, like a user's training script
    ns.script, ns.script_args = str(Path(__file__).with_name("selftest.py")), []
    ns.module = ns.no_python = False
    plan = make_plan(ns)
    print(f"accel test: {plan.nproc_per_node} process(es) per machine on {plan.nnodes} "
          "machine(s)", flush=True)
    code = run_plan(plan, "accel test")
    print(f"accel test: {'PASS' if code == 0 else f'FAIL (exit code {code})'}", flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``accel`` command; returns the exit code.

    Example:
        >>> main(["launch", "--nproc-per-node", "2", "train.py"])
        0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(args)
    try:
        from accel.cli.commands import run

        code = run(ns)
        if code is not None:
            return code
        if ns.command == "launch":
            from accel.launch.run import launch

            return launch(ns)
        if ns.command == "config":
            return _config(ns)
        if ns.command == "env":
            return _env(ns)
        return _test(ns)
    except AccelError as error:
        print(f"accel {ns.command}: error: {error}", file=sys.stderr)
        return 2


def module_main(argv: Sequence[str] | None = None) -> int:
    """``python -m accel.cli``: like ``accel``, the ``launch`` subcommand being optional.

    Example:
        >>> module_main(["train.py"])  # same as `accel launch train.py`
        0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in _COMMANDS and args[0] not in ("-h", "--help"):
        args = ["launch", *args]
    return main(args)


def exit_process(code: int) -> NoReturn:
    """End the command's process with ``code`` as Python would, minus the interpreter teardown.

    What a normal exit does that matters is done first: non-daemon threads are joined, the
    exit functions run (``atexit``, ``weakref.finalize``, logging's flush), stdout and stderr
    are flushed. What is skipped is tearing down every object and module one by one, which
    with torch imported takes ~0.6 s: a launch ends that much sooner. Only for the command's
    own process (the launcher, the tools), never for a training script's.

    Example:
        >>> exit_process(main())  # the `accel` console script
    """
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: Python would say nothing either
            pass
    os._exit(code)


def script_main() -> NoReturn:
    """The ``accel`` console script: :func:`main`, then :func:`exit_process`.

    Example:
        >>> script_main()  # argv from sys.argv
    """
    exit_process(main())
