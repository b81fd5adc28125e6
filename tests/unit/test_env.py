from __future__ import annotations

import pytest

from accel._env import read_launch_env
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
    assert env.master_port == 15042


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
