"""``python -m accel.cli [launch] script.py ...``: the ``accel`` command."""

from __future__ import annotations

from accel.cli.main import exit_process, module_main

if __name__ == "__main__":
    exit_process(module_main())
