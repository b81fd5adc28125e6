"""``accel env``: versions, hardware, the config file and the resolved settings, for bug reports."""

from __future__ import annotations

import importlib.util
import platform
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel.core.env import environ_snapshot, read_launch_env
from accel.core.settings import BACKENDS, cpu_count
from accel.errors import ConfigError
from accel.launch.config import Resolved

__all__ = ["FP8_TORCHAO_NOTE", "collect_env_info", "format_env_info", "relevant_variables"]

FP8_TORCHAO_NOTE = (
    "mixed_precision='fp8' needs torchao, which is not installed: "
    "`pip install 'accel[fp8]'` (prepare_model raises a ConfigError without it)."
)
"""What ``accel env`` notes under fp8 when torchao cannot be found."""


def _has_torchao() -> bool:
    """Whether torchao is installed (found, not imported)."""
    return importlib.util.find_spec("torchao") is not None

_PREFIXES = ("ACCEL_", "MASTER_", "NCCL_", "TORCH_", "TORCHELASTIC_", "PYTORCH_", "PET_",
             "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_LOCALID", "OMPI_COMM_WORLD_")
_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "WORLD_SIZE", "RANK", "LOCAL_RANK",
          "LOCAL_WORLD_SIZE", "GROUP_RANK", "XDG_CONFIG_HOME", "PMI_RANK", "PMI_SIZE")


def relevant_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that affect launching, sorted by name.

    Example:
        >>> relevant_variables({"ACCEL_DEBUG": "1", "HOME": "/root"})
        {'ACCEL_DEBUG': '1'}
    """
    return {
        name: environ[name]
        for name in sorted(environ)
        if name in _NAMES or name.startswith(_PREFIXES)
    }


def _gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append(f"{index}: {props.name} ({props.total_memory / 2**30:.1f} GiB)")
    return out


FSDP_BLOCKS_NOTE = (
    "strategy=fsdp shards, unless shard_modules says otherwise, the blocks the model declares "
    "(transformers' _no_split_modules, e.g. GPT2Block, LlamaDecoderLayer), else the children "
    "of its largest nn.ModuleList/nn.Sequential; prepare_model logs the blocks it chose at INFO "
    "level (docs/fsdp.md)."
)


def collect_env_info(
    settings: Mapping[str, Resolved], config_file: Path, config_reason: str
) -> dict[str, Any]:
    """Gather what ``accel env`` shows, as JSON-friendly data.

    Args:
        settings: the resolved settings (from ``resolve_settings``).
        config_file: the config file that applies (it may not exist).
        config_reason: why that file (``--config-file``, ``$ACCEL_CONFIG_FILE``, ...).

    Example:
        >>> info = collect_env_info(settings, Path("~/.config/accel/config.toml"), "default")
        >>> sorted(info)[:3]
        ['accel', 'config_file', 'cpus']
    """
    import torch

    from accel import __version__

    mixed_precision = settings["mixed_precision"].value if "mixed_precision" in settings else None
    strategy = settings["strategy"].value if "strategy" in settings else None
    return {
        "accel": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": f"{platform.python_version()} ({platform.python_implementation()}, "
                  f"{sys.executable})",
        "os": platform.platform(),
        "hostname": socket.gethostname(),
        "launch": _launch(),
        "cpus": cpu_count(),
        "gpus": _gpus(),
        "distributed_backends": [
            name for name in BACKENDS
            if torch.distributed.is_available()
            and getattr(torch.distributed, f"is_{name}_available", lambda: False)()
        ],
        "config_file": {"path": str(config_file), "chosen_by": config_reason,
                        "exists": config_file.is_file()},
        "settings": {key: {"value": item.value, "source": item.source}
                     for key, item in settings.items()},
        "environment": relevant_variables(environ_snapshot()),
        "notes": [
            *([FP8_TORCHAO_NOTE] if mixed_precision == "fp8" and not _has_torchao() else []),
            *([FSDP_BLOCKS_NOTE] if strategy == "fsdp" else []),
        ],
    }


def _launch() -> str:
    """Where the launcher placed this process, in one line (``none`` outside a launch)."""
    try:
        env = read_launch_env(environ_snapshot())
    except ConfigError as exc:
        return f"unreadable: {exc}"
    if env.launcher == "none":
        return "none (not started by a launcher)"
    master = f"{env.master_addr}:{env.master_port}" if env.master_addr else "unset"
    return (f"{env.launcher}: rank {env.rank} of {env.world_size}, node rank {env.node_rank} "
            f"of {env.num_nodes}, local rank {env.local_rank} of {env.local_world_size}, "
            f"master {master}")


def format_env_info(info: Mapping[str, Any]) -> str:
    """Render :func:`collect_env_info`'s data as text to paste into a bug report.

    Example:
        >>> print(format_env_info(info))  # doctest: +SKIP
        - accel: 0.1.0
        ...
    """
    gpus = info["gpus"] or ["none"]
    config = info["config_file"]
    state = "exists" if config["exists"] else "missing: defaults apply"
    lines = [
        f"- accel: {info['accel']}",
        f"- torch: {info['torch']} (CUDA {info['torch_cuda'] or 'not built'})",
        f"- Python: {info['python']}",
        f"- OS: {info['os']}",
        f"- host: {info.get('hostname', '?')}",
        f"- launch: {info.get('launch', '?')}",
        f"- CPUs: {info['cpus']}",
        f"- GPUs: {gpus[0]}",
        *(f"        {gpu}" for gpu in gpus[1:]),
        f"- torch.distributed backends: {', '.join(info['distributed_backends']) or 'none'}",
        f"- config file: {config['path']} ({config['chosen_by']}; {state})",
        "- settings (value  [from]):",
    ]
    width = max(len(key) for key in info["settings"])
    for key, item in info["settings"].items():
        value = "auto" if item["value"] is None else item["value"]
        lines.append(f"    {key:<{width}} = {value!s:<12} [{item['source']}]")
    lines.append("- environment variables:")
    variables = info["environment"] or {"(none set)": ""}
    lines += [f"    {name}={value}" if value else f"    {name}"
              for name, value in variables.items()]
    lines += [f"- note: {note}" for note in info.get("notes", ())]
    return "\n".join(lines)
