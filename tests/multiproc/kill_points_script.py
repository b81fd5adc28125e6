"""Kill ``save_state`` before each of its file-system operations in turn; report what loads.

``python kill_points_script.py ROOT MODE [KILLS]`` with MODE ``step`` (numbered checkpoints
with ``total_limit=2`` in a root that also holds the user's files) or ``fixed`` (one directory
replaced by every save). For k = 1, 2, ... a forked child saves new weights and ``os._exit``s
just before its k-th operation (rename, exchange, mkdir, fsync, unlink, rmtree); the parent then
loads the root and checks that it gets either the previous checkpoint or the new one, whole.
Then KILLS (default 20) forked children save in a loop and are SIGKILLed at random moments,
each followed by the same check. Prints one JSON line: the kill points and every problem.
"""

import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import accel
from accel._files import atomic as _atomic

root, mode = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)


def model_of(value: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def save(value: int) -> None:
    model = model_of(float(value))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "step":
        accel.save_state(root, step=value, total_limit=2, model=model, optimizer=opt)
    else:
        accel.save_state(root / "ckpt", model=model, optimizer=opt)


def load() -> float:
    model = model_of(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    where = root if mode == "step" else root / "ckpt"
    info = accel.load_state(where, model=model, optimizer=opt)
    values = {float(v) for p in model.parameters() for v in p.detach().flatten()}
    if len(values) != 1:
        raise AssertionError(f"mixed weights {sorted(values)}")
    value = values.pop()
    if info is not None and info.step is not None and info.step != value:
        raise AssertionError(f"step {info.step} holds weights {value}")
    return value


def kill_before(k: int) -> None:
    """Patch the file-system operations so that the k-th one ends the process first."""
    count = [0]

    def wrap(function):  # type: ignore[no-untyped-def]
        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            count[0] += 1
            if count[0] == k:
                os._exit(9)
            return function(*args, **kwargs)

        return counted

    for module, name in [(os, "replace"), (os, "rename"), (os, "mkdir"), (os, "fsync"),
                         (os, "unlink"), (os, "rmdir"), (shutil, "rmtree"),
                         (_atomic, "exchange")]:
        if hasattr(module, name):
            setattr(module, name, wrap(getattr(module, name)))


(root / "train_log.txt").parent.mkdir(parents=True, exist_ok=True)
(root / "train_log.txt").write_text("the user's file\n")
problems: list[str] = []
with accel.distributed():
    save(1)
    committed, points, value = 1.0, 0, 2
    for k in range(1, 200):
        pid = os.fork()
        if pid == 0:
            kill_before(k)
            save(value)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, 9):
            problems.append(f"kill before op {k}: the save itself failed (exit code {code})")
            break
        finished = code == 0
        try:
            got = load()
        except Exception as exc:
            problems.append(f"kill before op {k}: {type(exc).__name__}: {exc}")
            break
        if got not in (committed, float(value)):
            problems.append(f"kill before op {k}: loaded {got}, expected {committed} or {value}")
        if not (root / "train_log.txt").exists():
            problems.append(f"kill before op {k}: the user's file is gone")
        committed = got
        if finished:
            break
        points += 1
        if got == float(value):
            value += 1  # the new checkpoint became visible: the next save writes another
    rng, random_kills = random.Random(99), 0
    for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 20):
        pid = os.fork()
        if pid == 0:
            for n in range(value, value + 10_000):  # saves until killed
                save(n)
            os._exit(0)
        time.sleep(rng.uniform(0.005, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        try:
            got = load()
        except Exception as exc:
            problems.append(f"random kill: {type(exc).__name__}: {exc}")
            break
        if got < committed:
            problems.append(f"random kill: went back from {committed} to {got}")
        if not (root / "train_log.txt").exists():
            problems.append("random kill: the user's file is gone")
        committed, value, random_kills = got, int(got) + 1, random_kills + 1
    save(value + 1)  # a clean save repairs and removes every leftover, lock files too
    left = sorted(p.name for p in root.iterdir()
                  if ".tmp-" in p.name or ".old-" in p.name or ".trash-" in p.name
                  or p.name.endswith((".accel-lock", ".accel-checkpoints.lock")))
    if left:
        problems.append(f"leftovers after a clean save: {left}")
    if load() != float(value + 1):
        problems.append("the final clean save did not load")
print(json.dumps({"points": points, "random_kills": random_kills, "problems": problems}),
      flush=True)
