"""The toolbox subcommands of ``accel``: their parsers and what each one runs.

``accel estimate-memory``, ``accel merge-weights``, ``accel checkpoint inspect|verify`` and
``accel config import``. :func:`add_commands` registers them on the ``accel`` parser (the
``config`` parser gets its ``import`` subcommand from :func:`add_config_import`);
:func:`run` runs the one parsed. Exit codes: 0 done, 1 ``checkpoint verify`` found problems,
2 an error (an :class:`~accel.errors.AccelError`, printed by ``accel``'s ``main``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from accel.errors import ConfigError

__all__ = ["COMMANDS", "add_commands", "add_config_import", "run"]

COMMANDS = ("estimate-memory", "merge-weights", "checkpoint")


def add_commands(commands: Any) -> None:
    """Add the toolbox subcommands to ``accel``'s subparsers action ``commands``."""
    estimate = commands.add_parser(
        "estimate-memory", allow_abbrev=False,
        help="memory a model needs to train (per process) and to run",
        description="Estimate the memory a model needs, per dtype: inference, the largest "
                    "layer, and training per process (fp32 weights, compute copy, gradients, "
                    "optimizer states, DDP buckets). The model is built on the meta device; "
                    "nothing is downloaded. Activations are not counted.",
    )
    estimate.add_argument("model", metavar="MODEL",
                          help="a transformers config.json, a directory holding one, or "
                               "module:callable returning the model")
    estimate.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], metavar="D",
                          help="fp32 (no mixed precision), bf16, fp16 (default: fp32 bf16)")
    estimate.add_argument("--world-size", "--num-processes", type=int, default=1, metavar="N",
                          help="processes (default 1)")
    estimate.add_argument("--strategy", choices=("ddp", "fsdp", "none"), default="ddp",
                          help="ddp: a full copy per process; fsdp: split over the processes")
    estimate.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd-momentum"),
                          default="adamw", help="optimizer states to count (default adamw)")
    estimate.add_argument("--max-memory", nargs="+", metavar="DEVICE=SIZE",
                          help="budgets for the device map, e.g. 0=20GiB cpu=64GiB")
    estimate.add_argument("--tp-size", type=int, metavar="T",
                          help="tensor parallel size: not supported yet (only 1)")
    estimate.add_argument("--json", action="store_true", help="print JSON instead of text")

    merge = commands.add_parser(
        "merge-weights", allow_abbrev=False,
        help="a save_state checkpoint to one set of weights (save_model's layout)",
        description="Write the weights of a save_state checkpoint (FSDP-sharded at any world "
                    "size, DDP, one process), of an Accelerate save_state directory or of a "
                    "DeepSpeed save_checkpoint directory (its fp32 master weights) as "
                    "model.safetensors or shards + model.safetensors.index.json, one tensor at "
                    "a time, every file CRC-checked. OUT appears only when complete.",
    )
    merge.add_argument("checkpoint", metavar="CHECKPOINT",
                       help="the checkpoint, or the root of checkpoint_N directories")
    merge.add_argument("out", metavar="OUT", help="a new (or empty) directory")
    merge.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                       help="largest shard (default 5GB)")
    merge.add_argument("--dtype", metavar="D", help="cast floating weights: fp32, bf16, fp16")
    merge.add_argument("--object", dest="object_name", metavar="NAME",
                       help="the model's name in the checkpoint (default: model, or its only "
                            "model)")
    merge.add_argument("--config", metavar="PATH",
                       help="a config.json (or its directory) to copy into OUT")

    checkpoint = commands.add_parser(
        "checkpoint", allow_abbrev=False, help="inspect or verify a checkpoint",
        description="Look inside a save_state checkpoint (or an Accelerate one).",
    )
    actions = checkpoint.add_subparsers(dest="checkpoint_command", metavar="ACTION",
                                        required=True)
    inspect = actions.add_parser(
        "inspect", allow_abbrev=False, help="step, world size, mesh, objects, files, tensors",
        description="Describe a checkpoint: step, world size and mesh at save time, objects, "
                    "every file's size and verification status (size and CRC32), tensors.",
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--tensors", action="store_true",
                         help="list every tensor with its shape and dtype")
    inspect.add_argument("--no-crc", action="store_true",
                         help="check sizes only (no CRC32: faster on large checkpoints)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    verify = actions.add_parser(
        "verify", allow_abbrev=False, help="exit 1 on any missing, short or corrupted file",
        description="Verify every file of a checkpoint (a root: of every checkpoint_N) "
                    "against its manifest; exit 1 and list the problems on any mismatch.",
    )
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")


def add_config_import(config: argparse.ArgumentParser) -> None:
    """Add ``accel config import`` below the ``config`` parser."""
    actions = config.add_subparsers(dest="config_command", metavar="ACTION")
    imported = actions.add_parser(
        "import", allow_abbrev=False, help="convert an Accelerate config file",
        description="Convert an Accelerate config file (YAML or JSON) to accel's TOML config "
                    "file, printing what became of each key.",
    )
    imported.add_argument("source", nargs="?", metavar="ACCELERATE_YAML",
                          help="default: $HF_HOME/accelerate/default_config.yaml (else "
                               "~/.cache/huggingface/accelerate/default_config.yaml)")
    # SUPPRESS: given before `import` (`accel config --config-file F import`) they still count
    imported.add_argument("--config-file", "--config_file", metavar="F",
                          default=argparse.SUPPRESS,
                          help="where to write (default: $ACCEL_CONFIG_FILE, else "
                               "~/.config/accel/config.toml)")
    imported.add_argument("--force", action="store_true", default=argparse.SUPPRESS,
                          help="replace an existing file")
    imported.add_argument("--dry-run", action="store_true",
                          help="show what would be written, write nothing")


def _max_memory(items: list[str] | None) -> dict[Any, str] | None:
    if items is None:
        return None
    budgets: dict[Any, str] = {}
    for item in items:
        device, equals, size = item.partition("=")
        if not equals or not device or not size:
            raise ConfigError(
                f"--max-memory {item!r} is not DEVICE=SIZE; give e.g. `--max-memory 0=20GiB "
                "cpu=64GiB` (devices: GPU indices, cpu, disk)."
            )
        budgets[int(device) if device.isdigit() else device] = size
    return budgets


def _estimate(ns: argparse.Namespace) -> int:
    from accel.cli.estimate import estimate_memory, format_estimate

    if ns.tp_size is not None and ns.tp_size != 1:
        raise ConfigError(
            f"--tp-size {ns.tp_size}: estimate-memory does not estimate tensor-parallel "
            "layouts yet (training with tp_size works: docs/parallelism.md). Leave --tp-size "
            "out (or give 1), and use --strategy fsdp to estimate the data-parallel split."
        )
    report = estimate_memory(
        ns.model, dtypes=ns.dtypes, world_size=ns.world_size, strategy=ns.strategy,
        optimizer=ns.optimizer, max_memory=_max_memory(ns.max_memory),
    )
    print(json.dumps(report, indent=2) if ns.json else format_estimate(report))
    return 0


def _merge(ns: argparse.Namespace) -> int:
    from accel.cli.merge import merge_weights

    result = merge_weights(ns.checkpoint, ns.out, max_shard_size=ns.max_shard_size,
                           dtype=ns.dtype, object_name=ns.object_name, config=ns.config)
    foreign = "DeepSpeed" if result.kind == "deepspeed" else "Accelerate"
    check = ("every file read matched its manifest (size, CRC32)" if result.verified else
             f"{foreign} checkpoints carry no checksums: headers and sizes checked")
    print(f"accel merge-weights: {result.tensors} tensors of {result.object_name!r} from "
          f"{result.source} ({result.kind}) -> {result.out}: {', '.join(result.files)} "
          f"({result.total_bytes:,} bytes of weights); {check}.")
    if result.skipped:
        print(f"accel merge-weights: not weights, left out: {list(result.skipped)}")
    if "config.json" not in result.files:
        print("accel merge-weights: no config.json was written; transformers' from_pretrained "
              "needs one: pass --config path/to/config.json (or copy it into OUT).")
    return 0


def _checkpoint(ns: argparse.Namespace) -> int:
    from accel.cli.checkpoint_report import format_report, inspect_checkpoint, verify_checkpoint

    if ns.checkpoint_command == "inspect":
        report = inspect_checkpoint(ns.path, tensors=ns.tensors, check_crc=not ns.no_crc)
        print(json.dumps(report, indent=2) if ns.json else format_report(report))
        return 1 if report["problems"] else 0
    result = verify_checkpoint(ns.path)
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        for item in result["checkpoints"]:
            state = "OK" if not item["problems"] else f"{len(item['problems'])} problem(s)"
            print(f"{item['path']}: {state}")
            for problem in item["problems"]:
                print(f"  {problem}")
    return 0 if result["ok"] else 1


def _config_import(ns: argparse.Namespace) -> int:
    from accel.cli.config_import import Outcome, import_accelerate_config
    from accel.core.setting_values import toml_value

    def show(outcome: Outcome) -> None:
        if outcome.status == "mapped":
            note = f" ({outcome.reason})" if outcome.reason else ""
            print(f"  {outcome.key}: {outcome.value!r} -> {outcome.setting} = "
                  f"{toml_value(outcome.written)}{note}")
        else:
            print(f"  {outcome.key}: {outcome.value!r} {outcome.status}: {outcome.reason}")

    result = import_accelerate_config(ns.source, ns.config_file, force=ns.force,
                                      write=not ns.dry_run, report=show)
    if result.target is None:
        from accel.cli.config_import import toml_text

        print(f"accel config import: {result.source} (dry run, nothing written):")
        print(toml_text(result.settings, result.source), end="")
    else:
        print(f"accel config import: wrote {result.target} from {result.source}")
    return 0


def run(ns: argparse.Namespace) -> int | None:
    """Run the toolbox command ``ns`` names; ``None`` when it names none of them."""
    if ns.command == "estimate-memory":
        return _estimate(ns)
    if ns.command == "merge-weights":
        return _merge(ns)
    if ns.command == "checkpoint":
        return _checkpoint(ns)
    if ns.command == "config" and getattr(ns, "config_command", None) == "import":
        return _config_import(ns)
    return None

