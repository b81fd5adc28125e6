"""examples/deepspeed.py: the quicktour loop under ZeRO-3 on 2 CPU processes (warm workers).

Its full weights (``save_model``) load into the plain model, and its ``save_state`` checkpoint
loads into one plain process's model and AdamW with the same weights.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "deepspeed.py"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="needs the deepspeed extra"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.mark.ci_extra
def test_deepspeed_example_trains_and_its_checkpoint_loads_in_one_process(
    tmp_path: pathlib.Path,
) -> None:
    out = run_script(EXAMPLE, "--epochs", "2", "--data-len", "400", world_size=2, cwd=tmp_path,
                     env={"OMP_NUM_THREADS": "1"}).output
    accs = re.findall(r"^epoch \d: train loss \d+\.\d+ \| val acc (\d\.\d+)$", out, re.MULTILINE)
    assert len(accs) == 2, out[-2000:]
    assert float(accs[-1]) > 0.5
    weights = accel.load(tmp_path / "deepspeed_output" / "weights" / "model.safetensors")
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    model.load_state_dict(weights)
    with accel.distributed():
        plain = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=1e-2)
        accel.load_state(tmp_path / "deepspeed_output" / "state", model=plain,
                         optimizer=optimizer)
        assert int(optimizer.state_dict()["state"][0]["step"]) == 2 * 400 // 100
    for key, value in weights.items():
        torch.testing.assert_close(plain.state_dict()[key], value, atol=1e-6, rtol=0)
