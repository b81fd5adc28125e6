"""`accel estimate-memory` and `accel.estimate_memory`: figures against real models.

Every training figure is checked against a real run of the same model: the bytes of its
parameters, gradients and optimizer state tensors (and buffers) after one real AdamW step,
within 5%. Under mixed precision the compute copy is measured too: the bf16 casts of the
weights that autocast saves for the backward. The CLI runs in this process (`main([...])`).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.cli.main import main
from accel.testing import run_distributed
from tests.tied_models import gpt2, loss_of, tokens

pytest.importorskip("transformers")


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _measured(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this process holds in the model's parameters, gradients, buffers and the
    optimizer's state tensors (each tensor once; DTensors: the local shard)."""
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor)]
    return {
        "weights": sum(_bytes(p) for p in params),
        "gradients": sum(_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_states": sum(_bytes(t) for t in states),
        "buffers": sum(_bytes(b) for b in model.buffers()),
    }


def _adamw_step(model: nn.Module, ids: torch.Tensor) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accel.backward(loss_of(model, ids))
    optimizer.step()
    return optimizer


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code = main(["estimate-memory", *args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report: dict[str, Any] = json.loads(out.out)
    return report


def _close(estimate: int, measured: int) -> None:
    assert measured > 0
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    model: Any = gpt2()
    model.config.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def test_fp32_training_of_a_transformers_config_matches_a_real_adamw_step(
    gpt2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _cli_json(capsys, str(gpt2_dir / "config.json"), "--dtypes", "fp32", "bf16")
    model = gpt2()
    measured = _measured(model, _adamw_step(model, tokens(0)))
    assert report["model"] == "GPT2LMHeadModel"
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    fp32, bf16 = report["estimates"]
    training = fp32["training"]
    for key, value in measured.items():
        if value:
            _close(training[key], value)
    assert training["compute_copy"] == training["ddp_buckets"] == 0
    _close(training["total"], sum(measured.values()))
    # inference: the weights and buffers in the dtype, one copy
    model.to(torch.bfloat16)
    assert bf16["inference_bytes"] == sum(_bytes(t) for t in [*model.parameters(),
                                                              *model.buffers()])
    assert fp32["largest_layer"]["name"] == "transformer.h.0"  # a GPT2Block, never split


def _linear_stack_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "stack_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            torch.manual_seed(0)
            return nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stack_models", raising=False)
    return "stack_models:build"


def test_bf16_mixed_precision_state_and_compute_copy_match_a_real_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _linear_stack_module(tmp_path, monkeypatch)
    report = _cli_json(capsys, spec, "--dtypes", "bf16")
    (bf16,) = report["estimates"]
    import stack_models  # type: ignore[import-not-found]

    with accel.distributed(mixed_precision="bf16"):
        model = accel.prepare_model(stack_models.build())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        shapes = {tuple(p.shape) for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dtype == torch.bfloat16 and (
                tuple(tensor.shape) in shapes or tuple(tensor.shape[::-1]) in shapes
            ):
                saved[tensor.untyped_storage().data_ptr()] = _bytes(tensor)
            return tensor

        # an input needing its gradient (as every layer's but the first does): every
        # layer's bf16 weight is kept for the backward (the first layer's is otherwise freed
        # when the forward ends, after autocast's cache held it through the forward)
        x = torch.randn(8, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).float().pow(2).mean()
        accel.backward(loss)
        optimizer.step()
        measured = _measured(model, optimizer)
    training = bf16["training"]
    assert bf16["mixed_precision"] == "bf16"
    _close(training["total"] - training["compute_copy"], sum(measured.values()))
    _close(training["weights"], measured["weights"])  # the fp32 master copy
    _close(training["compute_copy"], sum(saved.values()))  # bf16 weights kept for backward


def _fsdp_rank(config_dir: str) -> dict[str, int] | None:
    with accel.distributed(strategy="fsdp"):
        st = accel.state()
        model = accel.prepare_model(gpt2())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        accel.backward(loss_of(model, tokens(0, st.rank, st.world_size)))
        optimizer.step()
        measured = _measured(model, optimizer)
    return measured if st.rank == 0 else None


@pytest.mark.slow  # two processes
def test_fsdp_per_process_state_matches_rank_0_of_a_real_two_process_step(
    gpt2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _cli_json(capsys, str(gpt2_dir), "--dtypes", "fp32", "--strategy", "fsdp",
                       "--world-size", "2")
    measured = run_distributed(_fsdp_rank, str(gpt2_dir), world_size=2)[0]
    assert measured is not None
    training = report["estimates"][0]["training"]
    for key, value in measured.items():
        if value:
            _close(training[key], value)
    _close(training["total"] - training["compute_copy"], sum(measured.values()))
    whole = _cli_json(capsys, str(gpt2_dir), "--dtypes", "fp32")["estimates"][0]["training"]
    assert training["weights"] < 0.6 * whole["weights"]  # about half on each of 2


def test_ddp_adds_gradient_buckets_and_sgd_has_no_state(
    gpt2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ddp = _cli_json(capsys, str(gpt2_dir), "--dtypes", "fp32", "--world-size", "4",
                    "--optimizer", "sgd")["estimates"][0]["training"]
    assert ddp["ddp_buckets"] == ddp["gradients"] > 0
    assert ddp["optimizer_states"] == 0


def test_the_function_takes_a_module_and_a_config_object(gpt2_dir: Path) -> None:
    model = gpt2()
    by_module = accel.estimate_memory(model, dtypes=["fp16"])
    by_config = accel.estimate_memory(model.config, dtypes=[torch.float16])
    assert by_module["estimates"] == by_config["estimates"]
    assert by_module["estimates"][0]["dtype"] == "fp16"
    placed = accel.estimate_memory(gpt2_dir, dtypes=["fp32"], max_memory={"cpu": "20KB"})
    device_map = placed["estimates"][0]["device_map"]
    assert set(device_map.values()) == {"cpu", "disk"}


def test_text_output_has_a_column_per_dtype(
    gpt2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate-memory", str(gpt2_dir), "--dtypes", "fp32", "bf16",
                 "--max-memory", "cpu=1GB"]) == 0
    text = capsys.readouterr().out
    assert "GPT2LMHeadModel" in text and "bf16 (mixed)" in text
    for row in ("inference", "largest layer", "training / process", "optimizer states"):
        assert row in text
    assert "device map in bf16" in text


@pytest.mark.parametrize(("args", "words"), [
    (["--tp-size", "2"], "does not estimate tensor-parallel layouts yet"),
    (["--dtypes", "int3"], "dtype 'int3' is not one accel estimates"),
    (["--world-size", "0"], "world_size=0 is invalid"),
    (["--max-memory", "cpu"], "is not DEVICE=SIZE"),
    (["--max-memory", "cpu=lots"], "is not a size"),
])
def test_bad_options_are_clear_errors(
    gpt2_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert main(["estimate-memory", str(gpt2_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel estimate-memory: error: ") and words in err, err


def test_bad_models_are_clear_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"model_type": "no-such-model"}')
    (tmp_path / "notjson.json").write_text("{oops")
    (tmp_path / "refused.json").write_text(json.dumps(  # a field of the wrong type
        {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
         "layer_norm_epsilon": "tiny"}))
    (tmp_path / "weird_models.py").write_text(
        "def build():\n    return 3\n\ndef needs(size):\n    return size\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "weird_models", raising=False)
    cases = {
        str(tmp_path / "missing.json"): "does not exist",
        str(tmp_path / "empty"): "holds no config.json",
        str(tmp_path / "bad.json"): "model_type='no-such-model'",
        str(tmp_path / "notjson.json"): "cannot be read as JSON",
        str(tmp_path / "refused.json"): "transformers refuses the model config",
        "weird_models:build": "returned a int, not a torch.nn.Module",
        "weird_models:needs": "Calling 'weird_models:needs' to build the model raised TypeError",
        "no_such_module_here:build": "Cannot import 'no_such_module_here'",
    }
    for source, words in cases.items():
        assert main(["estimate-memory", source]) == 2
        err = capsys.readouterr().err
        assert words in err, (source, err)


def test_a_config_object_with_sizes_no_model_has_is_refused_before_building(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import GPT2Config

    from accel.cli import model_source

    def never_built(*args: object) -> None:
        raise AssertionError("the model was being built: its sizes were not refused first")

    monkeypatch.setattr(model_source, "_from_config", never_built)
    with pytest.raises(accel.ConfigError, match=r"gives n_layer=1000000000; a layer count"):
        accel.estimate_memory(GPT2Config(n_layer=10**9, n_embd=64, n_head=4))
