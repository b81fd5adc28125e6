"""Shared helpers for the CLI tests: a clean environment, running `accel`, a training script."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from accel.cli.main import main as accel_main
from accel.cli.main import module_main

# A tiny data-parallel training run: every rank prints one RESULT line (JSON) with what it
# saw. The gradients are averaged over the ranks by hand: DistributedDataParallel and
# torch.optim would each import torch._dynamo (~1 s of every worker's start), and what these
# tests check is the launcher, not DDP (the examples' tests train with accel.prepare).
TRAIN_SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist
import accel

with accel.distributed() as st:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    gen = torch.Generator().manual_seed(st.rank)
    for _ in range(3):
        loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if st.world_size > 1:
                    dist.all_reduce(p.grad)
                    p.grad /= st.world_size
                p -= 0.1 * p.grad
                p.grad = None
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    info = {
        "rank": st.rank, "world": st.world_size, "local_rank": st.local_rank,
        "node_rank": st.node_rank, "num_nodes": st.num_nodes,
        "mixed_precision": st.mixed_precision,
        "gradient_accumulation_steps": st.gradient_accumulation_steps,
        "strategy": st.strategy, "backend": st.backend, "device": str(st.device),
        "port": os.environ.get("MASTER_PORT"), "omp": os.environ.get("OMP_NUM_THREADS"),
        "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"), "argv": sys.argv[1:],
        "ranks": accel.gather_object(st.rank), "weights": weights.tolist(),
    }
    print("RESULT " + json.dumps(info), flush=True)
'''


# launcher and accel variables, which clean_env leaves out
_DROP = ("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "TORCHELASTIC_",
         "PET_", "SLURM_", "OMPI_", "PMI_", "OMP_NUM_THREADS", "XDG_CONFIG_HOME")


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The test process's environment minus launcher/accel variables, with a private config dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def clean_env_changes(tmp_path: Path, **extra: str) -> dict[str, str | None]:
    """`clean_env` as changes to this process's environment (``None``: removed), for the
    ``env=`` of ``accel.testing.run_script``."""
    removed: dict[str, str | None] = {k: None for k in os.environ if k.startswith(_DROP)}
    return {**removed, **clean_env(tmp_path, **extra)}


def accel_command(*args: str) -> list[str]:
    """`accel ARGS` as a command line (through `python -m accel.cli`)."""
    return [sys.executable, "-m", "accel.cli", *args]


def run_accel(
    tmp_path: Path, *args: str, timeout: float = 90, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `accel ARGS` in ``tmp_path`` with a clean environment; capture its output."""
    return subprocess.run(
        accel_command(*args), cwd=tmp_path, env=clean_env(tmp_path, **env), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False,
    )


class _Both(io.StringIO):
    """Captures one stream and copies what it gets into a shared buffer (both streams)."""

    def __init__(self, both: io.StringIO) -> None:
        super().__init__()
        self.both = both

    def write(self, text: str) -> int:
        self.both.write(text)
        return super().write(text)


def call_accel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str, stdin: str | None = None,
    module: bool = False, **env: str,
) -> subprocess.CompletedProcess[str]:
    """`accel ARGS` in this process (the command's entry point), as `run_accel` runs it.

    ``module=True``: `python -m accel.cli ARGS`'s entry point (the subcommand optional).
    For commands that only parse, plan or read files: no interpreter start. The working
    directory, the environment (`clean_env`) and stdin are those of the run only;
    ``stdout`` holds stdout and stderr together (as `run_accel` gives them), ``stderr``
    stderr alone.
    """
    both = io.StringIO()
    out, err = _Both(both), _Both(both)
    with monkeypatch.context() as patch:
        for key in list(os.environ):
            if key.startswith(_DROP):
                patch.delenv(key)
        for key, value in {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PYTHONUNBUFFERED": "1",
                           **env}.items():
            patch.setenv(key, value)
        patch.chdir(tmp_path)
        patch.setattr(sys, "stdin", io.StringIO(stdin or ""))
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = (module_main if module else accel_main)(list(args))
            except SystemExit as exit:  # argparse's errors and --help
                code = exit.code if isinstance(exit.code, int) else 1
    return subprocess.CompletedProcess(["accel", *args], code, both.getvalue(),
                                       err.getvalue())


def results(output: str) -> list[dict[str, Any]]:
    """The RESULT records of the training script, by rank.

    Ranks share one output pipe, so two records may land on one line: each is decoded from
    where its marker starts, up to the end of its JSON object.
    """
    decoder = json.JSONDecoder()
    found = []
    start = output.find("RESULT ")
    while start != -1:
        record, end = decoder.raw_decode(output, start + len("RESULT "))
        found.append(record)
        start = output.find("RESULT ", end)
    return sorted(found, key=lambda r: int(r["rank"]))


def write_script(tmp_path: Path, text: str = TRAIN_SCRIPT, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc; empty where there is none)."""
    if not Path("/proc").is_dir():
        return []
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_bounded(
    command: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command``; past ``timeout`` kill it and everything it started, and fail the test.

    Unlike ``subprocess.run(timeout=...)``, which kills only the launcher, this also kills the
    workers it started (torch's agent puts them in sessions of their own), so a hang fails the
    test without leaving processes behind.
    """
    proc = subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended in the meantime
                pass
        output, _ = proc.communicate()
        pytest.fail(f"`{' '.join(command)}` did not end within {timeout} s (a hang?); "
                    f"its output:\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, output, None)


class Launched:
    """`accel launch ...` running in the background, its output collected line by line."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            accel_command("launch", *args), cwd=cwd, env=clean_env(cwd), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, count: int = 1, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.output.count(text) < count:  # ranks share the pipe: lines can merge
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"never saw {text!r} x{count}; output:\n{self.output[-4000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 180) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"accel launch did not end in {timeout} s:\n{self.output[-4000:]}")
        self._reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
