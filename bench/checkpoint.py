"""save_state / load_state throughput against dd and raw safetensors; prints JSON.

Model: 8 x Linear(4096, 4096) (~537 MB fp32) with AdamW state after one step (~1.6 GB in
all). In one run, for the same byte count:
- ``dd``: ``dd if=/dev/zero bs=64M conv=fdatasync`` writing, then reading the file back,
- ``safetensors``: ``safetensors.torch.save_file`` (+ fsync) of model and optimizer tensors,
  and ``load_file``,
- ``accel``: ``accel.save_state`` (atomic, fsynced, CRC32-checked) and ``accel.load_state``
  (verifies sizes and CRC32s).
Load times are "hot" (files in the page cache). Peak RSS growth during save is reported from
a background sampler, against the bytes of model + optimizer already in memory.

Usage: python bench/checkpoint.py [--dir /tmp/accel-bench] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

import accel


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    """Seconds taken, and the peak RSS growth over the starting RSS while it ran."""
    start_rss = _rss()
    peak = [start_rss]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    return elapsed, max(0, max(peak[0], _rss()) - start_rss)


def _dd(path: Path, nbytes: int) -> tuple[float, float]:
    blocks = max(1, nbytes // (64 << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={blocks}",
                    "conv=fdatasync"], check=True, capture_output=True)
    write = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M"], check=True,
                   capture_output=True)
    read = time.perf_counter() - start
    path.unlink()
    return write, read


def _flat_optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default="/tmp/accel-bench")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()},
               **{f"opt.{k}": v for k, v in _flat_optimizer_tensors(opt).items()}}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    report: dict[str, Any] = {"bytes": nbytes, "gb": round(nbytes / 1e9, 3),
                              "torch": torch.__version__, "python": sys.version.split()[0]}

    dd_write, dd_read = _dd(root / "dd.bin", nbytes)
    report["dd"] = {"write_s": round(dd_write, 3), "read_s": round(dd_read, 3),
                    "write_gb_s": round(nbytes / 1e9 / dd_write, 3)}

    raw_path = root / "raw.safetensors"

    def raw_save() -> None:
        safetensors.torch.save_file(tensors, str(raw_path))
        with open(raw_path, "rb+") as f:
            os.fsync(f.fileno())

    raw_save_s, raw_peak = _timed(raw_save)
    raw_load_s, _ = _timed(lambda: safetensors.torch.load_file(str(raw_path)))
    raw_path.unlink()
    report["safetensors"] = {"save_s": round(raw_save_s, 3), "load_s": round(raw_load_s, 3),
                             "save_gb_s": round(nbytes / 1e9 / raw_save_s, 3),
                             "save_peak_rss_growth_mb": round(raw_peak / 1e6, 1)}

    tensors = {}  # drop the references: only the model and optimizer hold memory now
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    with accel.distributed():
        save_s, save_peak = _timed(lambda: accel.save_state(root / "ckpt", step=1, model=model,
                                                            optimizer=opt))
        load_s, _ = _timed(lambda: accel.load_state(root / "ckpt", model=model, optimizer=opt))
    report["accel"] = {
        "save_state_s": round(save_s, 3),
        "load_state_s": round(load_s, 3),
        "save_gb_s": round(nbytes / 1e9 / save_s, 3),
        "save_peak_rss_growth_mb": round(save_peak / 1e6, 1),
        "largest_tensor_mb": round(largest / 1e6, 1),
    }
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
