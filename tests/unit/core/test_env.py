from __future__ import annotations

import os
from typing import get_args

import attrs
import pytest

from accel.core import setting_values
from accel.core import settings as settings_module
from accel.core.config_file import parse_config
from accel.core.env import (
    DERIVED_PORT_RANGE,
    LaunchEnv,
    read_launch_env,
)
from accel.core.setting_values import validate_setting
from accel.core.settings import (
    BACKENDS,
    DDP_HOOK_KEYS,
    DDP_KEYWORDS,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    FALSE_WORDS,
    MIXED_PRECISION_MODES,
    POLICY_KEYS,
    SETTINGS,
    STRATEGIES,
    TRUE_WORDS,
    cpu_count,
    env_variable,
)
from accel.errors import AccelError, ConfigError


def test_no_launcher_is_a_single_process() -> None:
    env = read_launch_env({})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("none", 0, 1, 0)
    assert env.mixed_precision is None and env.debug is None


def test_torchrun_variables() -> None:
    env = read_launch_env(
        {
            "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
        }
    )
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


def test_slurm_variables_and_node_list() -> None:
    env = read_launch_env(
        {
            "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "gpu[007-008],cpu1", "SLURM_JOB_ID": "42",
            "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0",
        }
    )
    assert env.launcher == "slurm"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert env.master_addr == "gpu007"
    assert env.master_port == 20042  # 20000 + job id % 12768 (step 0)


def test_slurm_interactive_shell_is_not_a_job_step() -> None:
    env = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "bash"})
    assert env.launcher == "none" and env.world_size == 1


def test_torchrun_wins_over_slurm() -> None:
    env = read_launch_env(
        {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
    )
    assert env.launcher == "torchrun" and env.world_size == 2


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
             "MASTER_ADDR": "node0"},
            (3, 4, 1, 2, 1, 2),
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            (1, 2, 1, 2, 0, 1),
        ),
    ],
)
def test_mpi_variables(variables: dict[str, str], expected: tuple[int, ...]) -> None:
    env = read_launch_env(variables)
    assert env.launcher == "mpi"
    got = (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank,
           env.num_nodes)
    assert got == expected
    assert env.master_port == 29500


def test_multi_node_mpi_without_master_addr_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        read_launch_env(
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
        )


def test_accel_options() -> None:
    env = read_launch_env(
        {"ACCEL_MIXED_PRECISION": "bf16", "ACCEL_GRADIENT_ACCUMULATION_STEPS": "4",
         "ACCEL_DEBUG": "1", "ACCEL_CPU": "false", "ACCEL_TIMEOUT": "60", "ACCEL_STRATEGY": "ddp"}
    )
    assert env.mixed_precision == "bf16" and env.gradient_accumulation_steps == 4
    assert env.debug is True and env.cpu is False and env.timeout == 60.0
    assert env.strategy == "ddp"


@pytest.mark.parametrize(
    ("name", "value"),
    [("WORLD_SIZE", "two"), ("ACCEL_DEBUG", "maybe"), ("ACCEL_TIMEOUT", "soon")],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    variables = {"RANK": "0", "WORLD_SIZE": "2", name: value}
    with pytest.raises(ConfigError, match=name) as info:
        read_launch_env(variables)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, AccelError) and isinstance(info.value, ValueError)


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(ConfigError, match="rank 2 outside"):
        read_launch_env({"RANK": "2", "WORLD_SIZE": "2"})


def _slurm(rank: int, job_id: str | None, **extra: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(rank % 2),
        "SLURM_NODEID": str(rank // 2), "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0",
        **extra,
    }
    if job_id is not None:
        env["SLURM_JOB_ID"] = job_id
    return env


def test_slurm_port_is_the_same_on_every_rank_and_differs_between_jobs() -> None:
    low, high = DERIVED_PORT_RANGE
    ports = {}
    for job_id in ("42", "43", "1000000", "98765432"):
        on_ranks = {read_launch_env(_slurm(rank, job_id)).master_port for rank in range(4)}
        assert len(on_ranks) == 1, on_ranks  # every task of the job agrees
        (ports[job_id],) = on_ranks
        assert ports[job_id] is not None and low <= ports[job_id] <= high
    assert len(set(ports.values())) == len(ports)  # two jobs on one node do not collide
    assert ports["42"] != 29500


def test_slurm_steps_of_one_job_get_different_ports() -> None:
    step0 = read_launch_env(_slurm(0, "42", SLURM_STEP_ID="0")).master_port
    step1 = read_launch_env(_slurm(0, "42", SLURM_STEP_ID="1")).master_port
    assert step0 != step1


def test_master_port_wins_over_the_derived_port() -> None:
    assert read_launch_env(_slurm(1, "42", MASTER_PORT="31337")).master_port == 31337
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "PMIX_NAMESPACE": "prterun-host-123@1", "MASTER_PORT": "31337"}
    assert read_launch_env(mpi).master_port == 31337


@pytest.mark.parametrize("value", ["0", "70000", "-1"])
def test_master_port_outside_the_port_range_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="MASTER_PORT") as info:
        read_launch_env(_slurm(0, "42", MASTER_PORT=value))
    assert repr(value) in str(info.value)


def test_slurm_without_a_job_id_uses_the_documented_default() -> None:
    assert read_launch_env(_slurm(0, None)).master_port == 29500


def test_slurm_master_addr_from_the_node_list() -> None:
    env = _slurm(2, "42")
    del env["SLURM_JOB_NODELIST"]
    env["SLURM_NODELIST"] = "node-[12-13]"
    assert read_launch_env(env).master_addr == "node-12"
    env["MASTER_ADDR"] = "10.1.1.1"
    assert read_launch_env(env).master_addr == "10.1.1.1"


@pytest.mark.parametrize(
    ("variable", "first", "second"),
    [
        ("PMIX_NAMESPACE", "prterun-node1-4242@1", "prterun-node1-4243@1"),  # Open MPI 5
        ("OMPI_MCA_ess_base_jobid", "2854617089", "2854617090"),  # Open MPI 4
        ("PMI_JOBID", "77.0", "78.0"),  # MPICH / Intel MPI under Slurm's PMI2
        ("SLURM_JOB_ID", "42", "43"),  # mpirun inside an sbatch script
    ],
)
def test_mpi_port_is_derived_from_the_job_id(variable: str, first: str, second: str) -> None:
    low, high = DERIVED_PORT_RANGE

    def port(rank: int, job: str) -> int | None:
        return read_launch_env(
            {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
             "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
             variable: job}
        ).master_port

    assert port(0, first) == port(1, first)
    assert port(0, first) != port(0, second)
    assert all(low <= p <= high for p in (port(0, first), port(0, second)) if p is not None)


def test_mpi_without_a_job_id_uses_the_documented_default() -> None:
    env = read_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (env.launcher, env.master_port) == ("mpi", 29500)


# ---- the settings are defined once (accel.core.settings) and read alike everywhere ----


@pytest.mark.parametrize("word", [*TRUE_WORDS, *FALSE_WORDS, "Y", " ON ", "False"])
def test_boolean_spellings_are_the_same_in_the_environment_and_the_config_file(
    word: str,
) -> None:
    expected = word.strip().lower() in TRUE_WORDS
    assert read_launch_env({"ACCEL_CPU": word}).cpu is expected
    assert read_launch_env({"ACCEL_ON_EACH_NODE": word}).on_each_node is expected
    assert validate_setting("cpu", word, "cfg.toml") is expected
    assert parse_config(f'debug = "{word}"') == {"debug": expected}


def test_environment_values_are_checked_like_config_values() -> None:
    cases = {
        "ACCEL_MIXED_PRECISION": ("fp32", "['no', 'fp16', 'bf16', 'fp8']"),
        "ACCEL_STRATEGY": ("megatron", "['none', 'ddp', 'fsdp', 'deepspeed']"),
        "ACCEL_BACKEND": ("tcp", "'gloo'"),
        "ACCEL_GRADIENT_ACCUMULATION_STEPS": ("0", ">= 1"),
        "ACCEL_TIMEOUT": ("-5", "> 0"),
        "ACCEL_CPU": ("maybe", "y/n"),
    }
    for name, (value, allowed) in cases.items():
        with pytest.raises(ConfigError) as info:
            read_launch_env({name: value})
        message = str(info.value)
        assert f"{name}={value!r}" in message and allowed in message, message
        assert f"`{name}=" in message  # how to fix it, as a variable


def test_environment_values_are_normalised_and_blank_means_unset() -> None:
    env = read_launch_env({"ACCEL_MIXED_PRECISION": " BF16 ", "ACCEL_STRATEGY": "DDP",
                           "ACCEL_TIMEOUT": "60", "ACCEL_DEBUG": "", "ACCEL_CPU": "  "})
    assert env.mixed_precision == "bf16" and env.strategy == "ddp" and env.timeout == 60.0
    assert env.debug is None and env.cpu is None


def test_every_policy_setting_is_read_from_its_variable() -> None:
    fields = {field.name for field in attrs.fields(LaunchEnv)}
    assert set(POLICY_KEYS) <= fields
    examples = {"int": "3", "float": "12.5", "bool": "yes", "choice": None}
    for key in POLICY_KEYS:
        spec = SETTINGS[key]
        text = examples[spec.kind] or spec.choices[-1]
        value = getattr(read_launch_env({env_variable(key): text}), key)
        assert value == validate_setting(key, text) and value is not None


def test_modules_take_the_definitions_from_the_settings_module() -> None:
    """Each setting's definition has one import path: accel.core.settings. The modules that
    use one import it and do not export it again."""
    import accel.core.env as env_module
    import accel.core.state as state_module
    import accel.launch.config as launch_config
    import accel.launch.run as run_module
    from accel.parallel import ddp as _ddp

    assert state_module.DEFAULT_TIMEOUT_S == DEFAULT_TIMEOUT_S == SETTINGS["timeout"].default
    assert launch_config.SETTINGS is SETTINGS
    assert (*DDP_KEYWORDS, *DDP_HOOK_KEYS) == _ddp.KNOWN_OPTIONS
    assert env_module.DEFAULT_PORT == run_module.DEFAULT_PORT == DEFAULT_PORT
    for module in (env_module, state_module, launch_config, run_module, _ddp):
        exported = set(getattr(module, "__all__", ()))
        assert not exported & set(settings_module.__all__), module.__name__
        assert not exported & set(setting_values.__all__), module.__name__
    assert get_args(settings_module.MixedPrecision) == MIXED_PRECISION_MODES
    assert get_args(settings_module.Strategy) == STRATEGIES
    assert SETTINGS["backend"].choices == BACKENDS
    assert SETTINGS["mixed_precision"].choices == MIXED_PRECISION_MODES


def test_cpu_count_is_the_affinity_mask() -> None:
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    assert cpu_count() >= 1
    if expected is not None:
        assert cpu_count() == expected
