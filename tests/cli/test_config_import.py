"""`accel config import`: Accelerate config files (YAML, JSON) to accel's TOML config file.

The CLI runs in this process (`main([...])`). Every test checks what was written (through
accel's own loader) or that nothing was; the last one converts a file written by Accelerate's
own `accelerate config default`.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from accel.cli.main import main
from accel.core.config_file import load_config
from accel.testing import run_script

pytest.importorskip("yaml")

FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def _import(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["config", "import", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _write(tmp_path: Path, text: str, name: str = "acc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_an_fsdp_config_maps_its_keys_and_explains_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = _write(tmp_path, FSDP_YAML), tmp_path / "out" / "accel.toml"
    code, out, _ = _import(capsys, str(source), "--config-file", str(target))
    assert code == 0
    assert load_config(target) == {
        "strategy": "fsdp", "mixed_precision": "bf16", "num_processes": 8, "num_machines": 1,
        "machine_rank": 0, "cpu": False, "debug": False,
    }
    assert target.read_text().startswith(f"# accel config file (imported from {source} by "
                                         "`accel config import`)")
    lines = out.splitlines()
    assert "  distributed_type: 'FSDP' -> strategy = \"fsdp\"" in lines
    assert "  use_cpu: False -> cpu = false" in lines
    assert "  fsdp_config.fsdp_cpu_ram_efficient_loading: True not imported: not supported as " \
           "a setting: build the model under `accel.init_empty_weights()` and load weights " \
           "with `accel.load_checkpoint_in_model`" in lines
    assert any(line.startswith("  fsdp_config.fsdp_transformer_layer_cls_to_wrap: "
                               "'LlamaDecoderLayer' not imported: no config key: pass the "
                               "class names as `accel.prepare_model(model, shard_modules=")
               for line in lines), out
    assert "  fsdp_config.fsdp_version: 2 not needed: accel's FSDP is FSDP2" in lines
    assert "  rdzv_backend: 'static' not needed: the value is what accel does anyway" in lines
    assert lines[-1] == f"accel config import: wrote {target} from {source}"
    # every key of the file is accounted for
    reported = {line.split(":")[0].strip() for line in lines[:-1]}
    assert reported == {k for k in _top_keys(FSDP_YAML) if k != "fsdp_config"} | {
        f"fsdp_config.{k}" for k in _fsdp_keys(FSDP_YAML)}


def _top_keys(text: str) -> set[str]:
    return {line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")}


def _fsdp_keys(text: str) -> set[str]:
    return {line.split(":")[0].strip() for line in text.splitlines() if line.startswith("  ")}


def test_multi_machine_ddp_and_what_cannot_be_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path, """\
        distributed_type: MULTI_GPU
        num_machines: 2
        num_processes: 16
        machine_rank: 1
        main_process_ip: 10.0.0.1
        main_process_port: 29501
        mixed_precision: fp8
        gpu_ids: 0,1,2,3,4,5,6,7
        dynamo_config:
          dynamo_backend: INDUCTOR
        deepspeed_config: {}
    """)
    target = tmp_path / "accel.toml"
    code, out, _ = _import(capsys, str(source), "--config-file", str(target))
    assert code == 0
    assert load_config(target) == {
        "strategy": "ddp", "num_machines": 2, "num_processes": 16, "machine_rank": 1,
        "main_process_ip": "10.0.0.1", "main_process_port": 29501, "mixed_precision": "fp8",
    }
    assert "mixed_precision: 'fp8' -> mixed_precision = \"fp8\" (torchao float8 training " \
        "(accel[fp8]))" in out
    assert "gpu_ids: '0,1,2,3,4,5,6,7' not imported: no config key: launch with " \
           "`CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7`" in out
    assert "dynamo_config: {'dynamo_backend': 'INDUCTOR'} not imported: no config key: pass " \
           "`accel.prepare_model(model, compile={...})`" in out
    assert "deepspeed_config: {} not needed" in out


def test_fsdp1_options_are_explained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path, """\
        distributed_type: FSDP
        fsdp_config:
          fsdp_backward_prefetch: BACKWARD_PRE
          fsdp_sharding_strategy: SHARD_GRAD_OP
          fsdp_state_dict_type: FULL_STATE_DICT
          fsdp_sync_module_states: true
          fsdp_offload_params: true
    """)
    code, out, _ = _import(capsys, str(source), "--dry-run")
    assert code == 0 and 'strategy = "fsdp"' in out
    expected = [
        "fsdp_backward_prefetch: 'BACKWARD_PRE' not needed: FSDP2 prefetches",
        "fsdp_sharding_strategy: 'SHARD_GRAD_OP' not imported: SHARD_GRAD_OP is "
        "`reshard_after_forward=False`",
        "fsdp_state_dict_type: 'FULL_STATE_DICT' not needed: save_state writes each rank's",
        "fsdp_sync_module_states: True not imported: accel does not broadcast rank 0's weights",
        "fsdp_offload_params: True not imported: no config key: pass "
        "`accel.distributed(cpu_offload=True)`",
    ]
    for words in expected:
        assert f"  fsdp_config.{words}" in out, (words, out)


def test_deepspeed_section_becomes_the_deepspeed_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path, """\
        distributed_type: DEEPSPEED
        deepspeed_config:
          deepspeed_config_file: /cfg/ds_zero3.json
          zero_stage: 3
          offload_optimizer_device: cpu
          offload_param_device: none
          gradient_accumulation_steps: 4
          gradient_clipping: 1.0
          zero3_init_flag: true
          zero3_save_16bit_model: true
          deepspeed_multinode_launcher: standard
        num_processes: 4
    """)
    target = tmp_path / "accel.toml"
    code, out, _ = _import(capsys, str(source), "--config-file", str(target))
    assert code == 0
    assert load_config(target) == {
        "strategy": "deepspeed", "deepspeed_config": "/cfg/ds_zero3.json", "zero_stage": 3,
        "offload_optimizer": "cpu", "offload_params": "none", "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0, "num_processes": 4,
    }
    assert ("deepspeed_config.zero3_init_flag: True not imported: a code change, not a setting: "
            "build the model inside `with accel.init_partitioned():`") in out
    assert "deepspeed_config.deepspeed_multinode_launcher: 'standard' not imported" in out
    # a stage accel refuses is refused here, naming the key
    bad = _write(tmp_path, "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n",
                 "bad.yaml")
    code, _, err = _import(capsys, str(bad), "--dry-run")
    assert code == 2 and "deepspeed_config.zero_stage" in err and "zero_stage=5" in err


@pytest.mark.parametrize(("text", "words"), [
    ("distributed_type: NO\nnum_procesess: 2\n",
     "keys Accelerate 1.15 does not know: 'num_procesess' (did you mean 'num_processes'?)"),
    ("num_processes: eight\n", "num_processes='eight' is invalid"),
    ("num_processes: 3\nnum_machines: 2\n", "is not a multiple of num_machines=2"),
    ("mixed_precision: fp4\n", "mixed_precision='fp4' is invalid"),
    ("- a\n- b\n", "holds a list, not a mapping"),
    ("a: [unclosed\n", "is not valid YAML"),
])
def test_bad_files_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    target = tmp_path / "cfg" / "accel.toml"
    code, out, err = _import(capsys, str(_write(tmp_path, text)), "--config-file", str(target))
    assert code == 2 and err.startswith("accel config: error: ") and words in err, err
    assert not (tmp_path / "cfg").exists() and out == ""


def test_default_locations_of_both_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    code, _, err = _import(capsys)
    assert code == 2 and str(tmp_path / "hf" / "accelerate" / "default_config.yaml") in err
    (tmp_path / "hf" / "accelerate").mkdir(parents=True)
    _write(tmp_path / "hf" / "accelerate", "distributed_type: 'NO'\nuse_cpu: true\n",
           "default_config.yaml")
    code, _, _ = _import(capsys)
    assert code == 0
    written = tmp_path / "xdg" / "accel" / "config.toml"
    assert load_config(written) == {"strategy": "none", "cpu": True}
    # an existing file is kept unless --force (given before or after `import`)
    code, _, err = _import(capsys)
    assert code == 2 and "already exists; not overwritten" in err
    assert main(["config", "--force", "import"]) == 0
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, _, err = _import(capsys, "--force")
    assert code == 2
    assert str(tmp_path / "cache" / "huggingface" / "accelerate" / "default_config.yaml") in err


def test_config_file_before_import_and_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path, "distributed_type: MULTI_CPU\nnum_processes: 4\n")
    target = tmp_path / "a.toml"
    assert main(["config", "--config-file", str(target), "import", str(source)]) == 0
    assert load_config(target) == {"strategy": "ddp", "num_processes": 4}
    capsys.readouterr()
    code, out, _ = _import(capsys, str(source), "--dry-run", "--config-file",
                           str(tmp_path / "b.toml"))
    assert code == 0 and "dry run, nothing written" in out and 'strategy = "ddp"' in out
    assert not (tmp_path / "b.toml").exists()


def test_json_config_needs_no_yaml_and_yaml_without_pyyaml_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    source = tmp_path / "acc.json"
    source.write_text(json.dumps({"distributed_type": "MULTI_GPU", "num_processes": 2}))
    target = tmp_path / "accel.toml"
    assert _import(capsys, str(source), "--config-file", str(target))[0] == 0
    assert load_config(target) == {"strategy": "ddp", "num_processes": 2}
    code, _, err = _import(capsys, str(_write(tmp_path, FSDP_YAML)), "--config-file",
                           str(tmp_path / "other.toml"))
    assert code == 2 and "pip install 'accel[yaml]'" in err, err
    assert not (tmp_path / "other.toml").exists()


@pytest.mark.slow  # runs Accelerate's own CLI
@pytest.mark.preload("accelerate", "accelerate.commands.accelerate_cli")
def test_a_file_written_by_accelerate_config_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("accelerate")
    source = tmp_path / "default_config.yaml"
    # `python -m accelerate.commands.accelerate_cli config default ...`, forked from the warm
    # workers (run_script(launch=False)): raises, quoting its traceback, if it fails
    cli = tmp_path / "accelerate_cli.py"
    cli.write_text("import runpy\n"
                   "runpy.run_module('accelerate.commands.accelerate_cli', run_name='__main__')\n")
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("ACCEL", "HF_"))}
    run_script(cli, "config", "default", "--config_file", str(source), "--mixed_precision",
               "bf16", world_size=1, launch=False, env=env, cwd=tmp_path, timeout=240)
    assert source.is_file()
    target = tmp_path / "accel.toml"
    code, out, _ = _import(capsys, str(source), "--config-file", str(target))
    assert code == 0, out
    settings = load_config(target)
    assert settings["mixed_precision"] == "bf16"
    assert settings["strategy"] in ("none", "ddp")
    assert "not imported" not in out  # a default config holds nothing accel lacks


def test_parallelism_config_and_activation_checkpointing_are_mapped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path, """\
        distributed_type: FSDP
        num_processes: 8
        fsdp_config:
          fsdp_version: 2
          fsdp_activation_checkpointing: true
        parallelism_config:
          parallelism_config_dp_replicate_size: 2
          parallelism_config_dp_shard_size: 2
          parallelism_config_tp_size: 2
          parallelism_config_cp_size: 1
    """)
    target = tmp_path / "accel.toml"
    code, out, _ = _import(capsys, str(source), "--config-file", str(target))
    assert code == 0, out
    assert load_config(target) == {
        "strategy": "fsdp", "num_processes": 8, "dp_replicate_size": 2, "dp_shard_size": 2,
        "tp_size": 2, "activation_checkpointing": True,
    }
    assert "parallelism_config.parallelism_config_tp_size: 2 -> tp_size = 2" in out
    assert "parallelism_config.parallelism_config_cp_size: 1 not needed" in out
    assert "fsdp_config.fsdp_activation_checkpointing: True -> activation_checkpointing = " \
           "true (the blocks FSDP shards)" in out


def test_context_parallelism_is_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path, """\
        distributed_type: FSDP
        parallelism_config:
          parallelism_config_cp_size: 2
          parallelism_config_cp_comm_strategy: allgather
    """)
    target = tmp_path / "accel.toml"
    code, out, _ = _import(capsys, str(source), "--config-file", str(target))
    assert code == 0, out
    assert load_config(target) == {"strategy": "fsdp", "cp_size": 2}
    assert "parallelism_config.parallelism_config_cp_size: 2 -> cp_size = 2" in out
    assert "parallelism_config.parallelism_config_cp_comm_strategy: 'allgather' not imported: " \
           "accel has no such setting" in out


@pytest.mark.parametrize(
    ("backend", "reason"),
    [("AO", "torchao's tensorwise recipe, as Accelerate's AO default"),
     ("TE", "accel uses torchao's float8 training, not Transformer Engine"),
     ("MSAMP", "accel uses torchao's float8 training, not MS-AMP")],
)
def test_fp8_config_becomes_torchaos_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str, reason: str
) -> None:
    source = _write(tmp_path, f"""\
        mixed_precision: fp8
        fp8_config:
          backend: {backend}
          enable_fsdp_float8_all_gather: true
          pad_inner_dim: true
          fp8_format: HYBRID
    """)
    target = tmp_path / "accel.toml"
    code, out, _ = _import(capsys, str(source), "--config-file", str(target))
    assert code == 0
    assert load_config(target) == {"mixed_precision": "fp8", "fp8_recipe": "tensorwise"}
    assert f"fp8_config.backend: '{backend}' -> fp8_recipe = \"tensorwise\" ({reason}" in out
    assert "fp8_config.enable_fsdp_float8_all_gather: True not needed: accel turns torchao's " \
           "float8 all-gather on itself" in out
    assert "fp8_config.pad_inner_dim: True not imported: no config key" in out
    assert "fp8_config.fp8_format: 'HYBRID' not imported: a Transformer Engine / MS-AMP " \
           "option" in out
