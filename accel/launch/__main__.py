"""``python -m accel.launch [launch] script.py ...``: the ``accel`` command."""

from __future__ import annotations

import sys

from accel.launch.cli import module_main

if __name__ == "__main__":
    sys.exit(module_main())
