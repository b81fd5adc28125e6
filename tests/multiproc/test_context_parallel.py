"""Context parallelism (``cp_size``) on gloo ranks equals one process.

The all-to-all attention equals full SDPA forward and backward (causal or not, grouped-query);
a transformers Llama trained with cp2 (2 ranks) and cp2 x dp_shard2 (4 ranks), and a GPT-2 with
cp2, give one process's losses, weights and predictions; a checkpoint saved at cp2 loads on one
process and takes the same next step; the refusals (heads, sequence length, padding masks) are
clear.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.errors import ConfigError
from accel.testing import run_distributed
from tests import cp_models as cm

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers not installed"),
    pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama",
                        "transformers.models.gpt2.modeling_gpt2"),
]
_REFERENCE: dict[tuple[Any, ...], dict[str, Any]] = {}


def _one_process(steps: int = cm.STEPS) -> dict[str, Any]:
    if steps not in _REFERENCE:
        _REFERENCE[steps] = run_distributed(cm.train, steps, world_size=1, timeout=120)[0]
    return _REFERENCE[steps]


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    assert got["weights"].keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(got["last"], want["last"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("causal", "heads", "kv_heads"), [(True, 4, 2), (False, 4, 4)])
def test_alltoall_attention_equals_full_attention(causal: bool, heads: int, kv_heads: int) -> None:
    for out in run_distributed(cm.attention, causal, heads, kv_heads, world_size=2, timeout=60,
                               cp_size=2):
        torch.testing.assert_close(out["out"], out["want"])
        for got, want in zip(out["grads"], out["want_grads"], strict=True):
            torch.testing.assert_close(got, want)


def test_llama_with_cp2_equals_one_process() -> None:
    out = run_distributed(cm.train, world_size=2, timeout=120, cp_size=2)
    _assert_same(out[0], _one_process())
    assert [o["cp"] for o in out] == [(0, 2), (1, 2)]
    assert [o["dp"] for o in out] == [(0, 1), (0, 1)]
    assert [o["mesh"] for o in out] == [(1, 1, 1, 2, 1)] * 2
    assert out[1]["losses"] == out[0]["losses"]
    assert [o["attn"] for o in out] == ["accel_cp_alltoall"] * 2


def test_gpt2_with_cp2_equals_one_process() -> None:
    out = run_distributed(cm.train, cm.STEPS, None, None, cm.SEQ, 0, "gpt2", world_size=2,
                          timeout=120, cp_size=2)
    want = run_distributed(cm.train, cm.STEPS, None, None, cm.SEQ, 0, "gpt2", world_size=1,
                           timeout=120)[0]
    _assert_same(out[0], want)


def test_llama_with_cp2_and_dp_shard2_equals_one_process() -> None:
    out = run_distributed(cm.train, world_size=4, timeout=180, cp_size=2, dp_shard_size=2)
    _assert_same(out[0], _one_process())
    assert [o["cp"] for o in out] == [(0, 2), (1, 2)] * 2
    assert [o["dp"] for o in out] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [o["mesh"] for o in out] == [(1, 1, 2, 2, 1)] * 4
    assert _one_process()["attn"] == "eager"


def test_a_cp2_checkpoint_takes_the_same_next_step_on_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from accel.cli.main import main

    saved = str(tmp_path / "cp2")
    run_distributed(cm.train, 2, saved, world_size=2, timeout=120, cp_size=2,
                    dp_shard_size=1, strategy="fsdp")  # FSDP over dp_shard x cp
    capsys.readouterr()
    assert main(["checkpoint", "inspect", saved, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"]["sizes"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}
    assert main(["checkpoint", "verify", saved]) == 0
    resumed = run_distributed(cm.train, 1, None, saved, cm.SEQ, 2, world_size=1,
                              timeout=120)[0]
    straight = _one_process()  # the same 3 steps without a break
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], abs=1e-5)
    for name, value in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, atol=1e-5, rtol=1e-5)


def test_refusals_name_the_fix() -> None:
    said = run_distributed(cm.refusals, world_size=2, timeout=60, cp_size=2)[0]
    assert "4 attention heads and 1 key/value heads" in said[0]
    assert "sequence length 7 does not divide by cp_size=2" in said[1]
    assert "takes no padding mask" in said[2]


def test_ring_needs_cuda_and_methods_are_checked() -> None:
    import accel

    with pytest.raises(ConfigError, match=r"torch's ring attention.*needs CUDA.*'alltoall'"):
        run_distributed(cm.train, world_size=2, timeout=60, cp_size=2, cp_method="ring")
    with pytest.raises(ConfigError, match="not a context parallel method"), \
            accel.distributed(cp_method="zigzag"):
        pass
