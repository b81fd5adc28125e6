"""`accel merge-weights` and `accel checkpoint inspect` of DeepSpeed's own checkpoint directories.

A transformers GPT-2 (tied embeddings) trains under real DeepSpeed on 2 gloo processes,
ZeRO-3 in bf16 (through `accel.prepare`) and ZeRO-2 in fp32 (a second engine from
`deepspeed.initialize`, in the same processes), and each saves with the engine's own
`save_checkpoint`; the directories merge to weights `from_pretrained` reads, equal to the
trained ones (the fp32 master weights: under bf16 they round to the engine's bf16 weights).
A file naming a global that is not DeepSpeed's (`os.system`) is refused without running it.
The CLI runs in this process (`main([...])`). `accel.load_state` reads the same directories
(the fp32 master weights, Adam's state per parameter; tests/multiproc/test_deepspeed_dir_resume.py
resumes training from them).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import accel
from accel.cli.main import main
from accel.testing import run_distributed
from tests.tied_models import gpt2, tokens

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="needs the deepspeed extra"),
    pytest.mark.preload("transformers", "transformers.models.gpt2.modeling_gpt2", "deepspeed",
                        "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3",
                        "deepspeed.runtime.zero.stage_1_and_2"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _train(root: str) -> dict[str, dict[str, torch.Tensor]]:
    st = accel.state()
    ids = torch.cat([tokens(i, st.rank, st.world_size) for i in range(2)])
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(ids, batch_size=len(ids) // 2)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    for batch in loader:
        accel.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    model.save_checkpoint(os.path.join(root, "zero3"))  # DeepSpeed's layout: latest, TAG/...
    return {"zero3": accel.get_state_dict(model), "zero2": _zero2(root, ids)}


def _zero2(root: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A second engine in the same processes (accel prepares one per block): DeepSpeed's own
    `initialize` with a ZeRO-2 fp32 config, one step, its own `save_checkpoint`."""
    import deepspeed

    model = gpt2(seed=1)
    config = {"train_micro_batch_size_per_gpu": len(ids), "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(os.path.join(root, "zero2"))
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ds")
    result = run_distributed(_train, str(root), world_size=2, timeout=120,
                             strategy="deepspeed", zero_stage=3, mixed_precision="bf16")[0]
    model: Any = gpt2()
    model.config.save_pretrained(root / "config")
    return {"root": root, **result}


@pytest.mark.ci_extra
def test_zero2_directory_merges_to_from_pretrained_weights(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    import transformers

    root = saved["root"]
    tag = (root / "zero2" / "latest").read_text().strip()  # DeepSpeed's layout: latest -> tag
    assert (root / "zero2" / tag / "mp_rank_00_model_states.pt").is_file()
    out = tmp_path / "out"
    assert main(["merge-weights", str(root / "zero2"), str(out), "--config",
                 str(root / "config")]) == 0
    written = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in written  # tied: written once, under the embedding's name
    trained = saved["zero2"]
    assert all(torch.equal(written[k], trained[k]) for k in written)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    for key, value in trained.items():
        if key.endswith(".attn.bias") or key.endswith(".masked_bias"):
            continue  # non-persistent buffers of older transformers
        assert torch.equal(loaded[key], value.float()), key


def test_zero3_bf16_directory_merges_fp32_master_weights(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert main(["merge-weights", str(saved["root"] / "zero3"), str(out)]) == 0
    written = load_file(out / "model.safetensors")
    trained = saved["zero3"]
    assert written and all(t.dtype == torch.float32 for t in written.values())
    for key, value in written.items():  # the engine's bf16 weights are the masters, rounded
        assert torch.equal(value.to(trained[key].dtype), trained[key]), key


def test_load_state_reads_both_directories_bf16_masters_and_adam_state(
    saved: dict[str, Any]
) -> None:
    for kind in ("zero2", "zero3"):
        model: Any = gpt2(seed=5)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        with accel.distributed(), pytest.warns(UserWarning, match="RNG states"):
            info = accel.load_state(saved["root"] / kind, model=model, optimizer=optimizer)
        assert info is not None and info.objects == ("model", "optimizer")
        trained = saved[kind]
        for key, value in model.state_dict().items():
            if key in trained:  # zero3 ran in bf16: its fp32 masters round to its weights
                assert torch.equal(value.to(trained[key].dtype), trained[key]), (kind, key)
        assert model.lm_head.weight is model.transformer.wte.weight
        assert optimizer.param_groups[0]["lr"] == 1e-2
        for param in model.parameters():
            state = optimizer.state[param]
            assert state["exp_avg"].shape == param.shape and state["exp_avg"].dtype == torch.float32
            assert float(state["step"]) == info.step and info.step in (1, 2)


def test_inspect_says_deepspeed_tag_stage_world_size_parameters(
    saved: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoint", "inspect", str(saved["root"] / "zero3"), "--json",
                 "--tensors"]) == 0
    report = json.loads(capsys.readouterr().out)
    count = sum(p.numel() for p in gpt2().parameters())  # the tied head counted once
    assert (report["format"], report["zero_stage"], report["world_size"],
            report["parameters"], report["problems"]) == ("deepspeed", 3, 2, count, [])
    assert report["tag"] == (saved["root"] / "zero3" / "latest").read_text().strip()
    assert report["objects"][0]["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert main(["checkpoint", "inspect", str(saved["root"] / "zero2")]) == 0
    text = capsys.readouterr().out
    assert "ZeRO stage 2, saved by 2 process(es)" in text and "parameters: " in text


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_global_that_is_not_deepspeeds_is_refused_unrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = tmp_path / "ds"
    (ds / "step1").mkdir(parents=True)
    (ds / "latest").write_text("step1")
    marker = tmp_path / "ran"
    state = {"module": {"w": torch.ones(2)}, "buffer_names": [], "param_shapes": [{"w": (2,)}],
             "args": _Payload(marker)}
    torch.save(state, ds / "step1" / "mp_rank_00_model_states.pt")
    assert main(["merge-weights", str(ds), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "system" in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()
    main(["checkpoint", "inspect", str(ds)])
    assert "refused" in capsys.readouterr().out and not marker.exists()
