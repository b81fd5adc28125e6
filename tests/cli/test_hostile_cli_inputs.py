"""Hostile input to `accel config import`, `accel estimate-memory` and `accel checkpoint`.

Each command ends quickly with a clear error (or, for a checkpoint, a listed problem) on a
small crafted file that once made it run away or report nonsense:

* `config import`: YAML aliases (a "billion laughs" of a few hundred bytes), deep nesting, an
  oversized file, and values too long to print in the report;
* `estimate-memory`: layer counts, widths, vocabularies and head counts no model has (or that
  are not positive whole numbers), refused before anything is built;
* `checkpoint verify` / `inspect`: a recorded mesh whose sizes are not positive, or do not
  multiply to the number of ranks that wrote pieces.

A case that ran away before its fix runs in a child under a memory and CPU limit (the
billion laughs), or in this process behind a guard that fails the test at once if the
refusal is missing (the model is never built here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel._files.format import FileRecord
from accel._files.objects import plan_object
from accel._files.writer import write_files
from accel.cli import model_source
from accel.cli.main import main

# -- accel config import -------------------------------------------------------------------


def _laughs(key: str, anchors: int = 9, levels: int = 9, indent: str = "  ") -> str:
    """``key:`` holding a "billion laughs": ``levels`` anchors, each a list of ``anchors``
    aliases of the one before (``anchors ** levels`` strings once expanded)."""
    lines = [f"{key}:", f"{indent}l0: &l0 [" + ", ".join(['"lol"'] * anchors) + "]"]
    for level in range(1, levels):
        lines.append(f"{indent}l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * anchors)
                     + "]")
    return "\n".join(lines) + "\n"


def _import(capsys: pytest.CaptureFixture[str], source: Path, *args: str) -> tuple[int, str, str]:
    code = main(["config", "import", str(source), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# the child sets its own limits, so that a missing refusal fails the test instead of the machine
_BOUNDED_CHILD = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (20, 20))
    from accel.cli.main import main
    raise SystemExit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize(("key", "dry_run"), [
    ("deepspeed_config", True), ("dynamo_config", False), ("fsdp_config", True),
    ("megatron_lm_config", False),
])
def test_a_billion_laughs_is_refused_at_once_with_or_without_dry_run(
    tmp_path: Path, key: str, dry_run: bool
) -> None:
    source = tmp_path / "laughs.yaml"
    source.write_text("distributed_type: MULTI_GPU\n" + _laughs(key))
    assert source.stat().st_size < 1000
    target = tmp_path / "accel.toml"
    args = ["config", "import", str(source), "--config-file", str(target)]
    done = subprocess.run(
        [sys.executable, "-c", _BOUNDED_CHILD, *args, *(["--dry-run"] if dry_run else [])],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stdout == "" and not target.exists()
    err = done.stderr
    assert err.startswith("accel config: error: ") and len(err) < 1000, err
    assert f"{key}.l0" in err and "YAML anchor" in err and "&l0" in err, err


@pytest.mark.parametrize(("text", "words"), [
    # an alias inside a nested list
    ("fsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: [&block LlamaDecoderLayer, *block]\n",
     "fsdp_config.fsdp_transformer_layer_cls_to_wrap[0]"),
    # an anchor alone (nothing refers to it yet)
    ("dynamo_config: &dynamo\n  dynamo_backend: INDUCTOR\n", "dynamo_config"),
    # a merge key, the usual use of an alias
    ("deepspeed_config:\n  base: &base {zero_stage: 3}\n  more:\n    <<: *base\n",
     "deepspeed_config.base"),
    # a small bomb (9 ** 4 strings once expanded)
    ("distributed_type: NO\n" + _laughs("megatron_lm_config", levels=4),
     "megatron_lm_config.l0"),
])
def test_yaml_anchors_and_aliases_are_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    source = tmp_path / "acc.yaml"
    source.write_text(text)
    code, out, err = _import(capsys, source, "--dry-run")
    assert code == 2 and out == "", out[:500]
    assert err.startswith("accel config: error: ") and words in err and "YAML" in err, err
    assert "`" in err and len(err) < 1000, err  # the fix, in backticks; short


@pytest.mark.parametrize(("name", "text", "limit"), [
    ("deep.yaml", "deepspeed_config: " + "[" * 3000 + "]" * 3000 + "\n", "32"),
    ("deep.json", '{"deepspeed_config": ' + "[" * 100_000 + "]" * 100_000 + "}", "32"),
    # deep enough to be refused, not enough to reach Python's recursion limit
    ("nested.yaml", "fsdp_config:\n  fsdp_version: 2\ndynamo_config: " + "{a: " * 40
     + "1" + "}" * 40 + "\n", "32"),
    ("nested.json", '{"dynamo_config": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}", "32"),
])
def test_deep_nesting_without_aliases_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, limit: str
) -> None:
    source = tmp_path / name
    source.write_text(text)
    code, out, err = _import(capsys, source, "--dry-run")
    assert code == 2 and out == "", out[:500]
    key = "deepspeed_config" if "deep." in name else "dynamo_config"
    assert err.startswith("accel config: error: ") and key in err, err[:2000]
    assert f"more than {limit} levels" in err and len(err) < 1000, err[:2000]


def test_nesting_within_the_limit_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "ok.yaml"
    source.write_text("distributed_type: MULTI_GPU\nmegatron_lm_config: " + "{a: " * 20 + "1"
                      + "}" * 20 + "\n")
    code, out, _ = _import(capsys, source, "--dry-run")
    assert code == 0 and "megatron_lm_config: {'a': {'a': " in out


@pytest.mark.parametrize("name", ["big.yaml", "big.json"])
def test_a_file_over_the_size_limit_is_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    source = tmp_path / name
    with open(source, "wb") as f:
        f.write(b"distributed_type: NO\n" if name.endswith("yaml") else b"{}")
        f.truncate(2 << 20)  # sparse: nothing is written
    code, out, err = _import(capsys, source, "--dry-run")
    assert code == 2 and out == ""
    assert err.startswith("accel config: error: ") and repr(str(source)) in err, err
    assert "2097152 bytes" in err and "1048576" in err and "checkpoint" not in err, err


def test_a_long_value_is_shown_as_a_bounded_preview(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = "x" * 200_000
    source = tmp_path / "acc.json"
    source.write_text(json.dumps({
        "distributed_type": "MULTI_GPU",
        "megatron_lm_config": {"zero_stage": 3, "notes": [long]},
        "deepspeed_config": {"zero_stage": 3, "notes": [long]},
        "gpu_ids": "0," * 100_000 + "0",
        "tpu_env": [long],
    }))
    code, out, _ = _import(capsys, source, "--dry-run")
    assert code == 0
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    for key in ("megatron_lm_config", "deepspeed_config.notes", "gpu_ids", "tpu_env"):
        assert len(lines[key]) < 800, (key, len(lines[key]))
        assert "characters" in lines[key], lines[key][:800]
    assert lines["megatron_lm_config"].startswith("  megatron_lm_config: {'zero_stage': 3, 'not")
    assert len(out) < 5000


@pytest.mark.parametrize(("text", "words"), [
    ("num_processes: " + "1" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
    ("fsdp_config: {fsdp_version: 2001-13-45}\n", "month must be in 1..12"),
    ("deepspeed_config: !!python/object:os.system {}\n", "could not determine a constructor"),
])
def test_values_the_yaml_loader_cannot_build_are_errors_not_tracebacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    source = tmp_path / "acc.yaml"
    source.write_text(text)
    code, out, err = _import(capsys, source, "--dry-run")
    assert code == 2 and out == "" and "is not valid YAML" in err and words in err, err
    assert len(err) < 1000, err


def test_a_long_value_for_a_setting_is_refused_briefly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "acc.json"
    source.write_text(json.dumps({"num_processes": "8" * 300_000}))
    code, out, err = _import(capsys, source, "--dry-run")
    assert code == 2 and out == "" and "num_processes" in err and len(err) < 1000, err[:2000]


# -- accel estimate-memory ------------------------------------------------------------------


def _never_built(*args: object) -> None:
    raise AssertionError("the model was being built: its sizes were not refused first")


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model fails the test at once (a hostile size must be refused before)."""
    monkeypatch.setattr(model_source, "_from_config", _never_built)


_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
         "n_positions": 128}


@pytest.mark.parametrize(("change", "words"), [
    ({"n_layer": 10**12}, "n_layer=1000000000000"),
    ({"n_layer": 1e12}, "n_layer=1000000000000.0"),  # a float: not a whole number
    ({"n_layer": 12.5}, "n_layer=12.5"),
    ({"n_layer": "12"}, "n_layer='12'"),  # a string
    ({"n_layer": 0}, "n_layer=0"),
    ({"n_layer": -3}, "n_layer=-3"),
    ({"n_layer": True}, "n_layer=True"),
    ({"n_layer": 100_001}, "n_layer=100001"),
    ({"n_embd": 1 << 40}, "n_embd=1099511627776"),
    ({"vocab_size": 10**30}, "vocab_size=1000000000000000000000000000000"),
    ({"n_head": 1 << 20}, "n_head=1048576"),
    ({"n_inner": 10**15}, "n_inner=1000000000000000"),
    ({"n_positions": -1}, "n_positions=-1"),
    ({"text_config": {"num_hidden_layers": 10**9}}, "text_config.num_hidden_layers=1000000000"),
    ({"intermediate_size": [64, 10**12]}, "intermediate_size[1]=1000000000000"),
])
def test_sizes_no_model_has_are_refused_before_building(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], guarded: None,
    change: dict[str, Any], words: str
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_GPT2, **change}))
    code = main(["estimate-memory", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("accel estimate-memory: error: "), err
    assert words in err and repr(str(config)) in err and "`" in err and len(err) < 1000, err


def test_sizes_whose_product_passes_a_float64_byte_count_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], guarded: None
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_GPT2, "n_layer": 10_000, "n_embd": 1 << 20}))
    code = main(["estimate-memory", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and "n_layer=10000" in err and "n_embd=1048576" in err, err
    assert "parameters" in err and "2**53" in err, err


def test_the_python_function_refuses_them_too(tmp_path: Path, guarded: None) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_GPT2, "num_hidden_layers": 10**7}))
    with pytest.raises(accel.ConfigError, match=r"num_hidden_layers=10000000"):
        accel.estimate_memory(tmp_path)


# -- accel checkpoint verify / inspect: the recorded mesh ---------------------------------

_FULL = torch.arange(16.0).reshape(4, 4)


def _write_object(folder: Path, name: str, state: Any, extra: dict[str, Any]) -> list[FileRecord]:
    return write_files(plan_object(folder, name, state, extra))


def _mesh_checkpoint(folder: Path, mesh: Any, ranks: int = 2) -> Path:
    """A Linear(4, 4)'s weight saved as ``ranks`` ranks' FSDP pieces (rows split evenly),
    the model's structure file recording ``mesh`` as save_state does (``extra["mesh"]``)."""
    folder.mkdir(parents=True)
    extra: dict[str, Any] = {"accumulation_step": None,
                             "sharded": {"weight": {"shape": [4, 4], "dtype": "float32"}}}
    if mesh is not None:
        extra["mesh"] = mesh
    records = _write_object(folder, "model", {"weight": {"__accel_shard__": "weight"},
                                             "bias": torch.zeros(4)}, extra)
    rows = 4 // ranks
    for rank in range(ranks):
        where = {"weight": {"offset": [rank * rows, 0], "shape": [rows, 4]}}
        records += _write_object(folder, f"model__shards_rank{rank}",
                                {"weight": _FULL[rank * rows:(rank + 1) * rows].clone()},
                                {"pieces": where})
    manifest = {
        "format": "accel-checkpoint", "version": 1, "step": 5, "world_size": ranks,
        "ranks": list(range(ranks)), "objects": ["model"],
        "files": [{"name": r.name, "size": r.size, "crc32": r.crc32, "rank": 0}
                  for r in records],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _checkpoint(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["checkpoint", *args])
    return code, capsys.readouterr().out


def test_a_consistent_recorded_mesh_is_reported_as_fact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _mesh_checkpoint(tmp_path / "ok", {"dims": ["dp_shard", "tp"], "shape": [2, 1]})
    assert _checkpoint(capsys, "verify", str(folder)) == (0, f"{folder}: OK\n")
    code, out = _checkpoint(capsys, "inspect", str(folder), "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == []
    assert report["mesh"]["sizes"] == {"dp_shard": 2, "tp": 1}
    code, out = _checkpoint(capsys, "inspect", str(folder))
    assert code == 0 and "mesh: 2-D (dp_shard=2, tp=1) over 2 ranks" in out


@pytest.mark.parametrize(("mesh", "words"), [
    ({"dims": ["dp_shard", "tp"], "shape": [2, 0]}, "[2, 0]"),  # a size zero
    ({"dims": ["dp_shard", "tp"], "shape": [-2, -1]}, "[-2, -1]"),  # negative, product 2
    ({"dims": ["dp_shard"], "shape": [-2]}, "[-2]"),
    ({"dims": ["dp_shard", "tp"], "shape": [2, 2]}, "4 ranks"),  # product 4, 2 ranks wrote
    ({"dims": ["dp_shard"], "shape": [1]}, "1 rank"),
    ({"dims": ["dp_shard"], "shape": ["2"]}, "['2']"),  # a string size
    ({"dims": ["dp_shard"], "shape": [2.0]}, "[2.0]"),  # a float size
    ({"dims": ["dp_shard"], "shape": [True, 2]}, "[True, 2]"),
    ({"dims": ["dp_shard", "tp"], "shape": [2]}, "['dp_shard', 'tp']"),  # lengths differ
    ({"dims": ["dp shard"], "shape": [2]}, "['dp shard']"),
    ({"dims": ["tp", "tp"], "shape": [2, 1]}, "['tp', 'tp']"),
    ([2, 1], "[2, 1]"),  # not a mapping
])
def test_a_recorded_mesh_that_does_not_fit_the_pieces_is_a_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mesh: Any, words: str
) -> None:
    folder = _mesh_checkpoint(tmp_path / "bad", mesh)
    code, out = _checkpoint(capsys, "verify", str(folder))
    assert code == 1 and f"{folder}: 1 problem(s)" in out, out
    problem = out.splitlines()[1]
    assert "model: " in problem and "recorded mesh" in problem and words in problem, problem
    code, out = _checkpoint(capsys, "inspect", str(folder), "--json")
    report = json.loads(out)
    assert code == 1 and report["problems"] == [problem.strip()]
    assert "sizes" not in report["mesh"] and report["mesh"]["invalid"] == problem.strip()
    code, out = _checkpoint(capsys, "inspect", str(folder))
    assert code == 1 and "mesh: not known: the recorded mesh is invalid" in out, out
    assert f"  {problem.strip()}" in out.split("problems:")[1]
    # loading ignores the record: the pieces are whole
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accel.load_state(folder, model=model)
    assert torch.equal(model.weight.detach(), _FULL)


def test_a_mesh_over_ranks_that_did_not_all_write_pieces_is_a_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 4 ranks wrote pieces; the record says 2 x 2 = 4 but one rank's piece file is renamed
    folder = _mesh_checkpoint(tmp_path / "ok4", {"dims": ["dp_shard", "tp"], "shape": [2, 2]},
                              ranks=4)
    assert _checkpoint(capsys, "verify", str(folder))[0] == 0
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        for suffix in (".json", ".safetensors"):
            if entry["name"] == f"model__shards_rank3{suffix}":
                (folder / entry["name"]).rename(folder / f"model__shards_rank7{suffix}")
                entry["name"] = f"model__shards_rank7{suffix}"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    code, out = _checkpoint(capsys, "verify", str(folder))
    assert code == 1 and "ranks [0, 1, 2, 7]" in out and "recorded mesh" in out, out
