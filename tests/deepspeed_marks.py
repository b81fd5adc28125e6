"""The marks every DeepSpeed multi-process test file carries: skipped without the extra, the
warm server importing DeepSpeed's engine and ZeRO modules once, DeepSpeed's FutureWarnings
quiet. Use as ``pytestmark = DEEPSPEED`` (or a list starting with it)."""

from __future__ import annotations

import importlib.util

import pytest

DEEPSPEED = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="needs the deepspeed extra"),
    pytest.mark.preload("deepspeed", "deepspeed.runtime.engine",
                        "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
