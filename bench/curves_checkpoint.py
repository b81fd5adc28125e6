"""save_state / load_state vs safetensors by size on tmpfs, and by ranks writing FSDP pieces.

Two curves (JSON, ``--json-out DIR``, default bench/curves; ``-`` prints only):

``checkpoint_size`` — for each size of ``--sizes`` (GB of tensors; default 0.1 0.5 1.6 4):
a model of 8 ``Linear(w, w)`` layers (w chosen for the size: 16 tensors at every size), in
one process, files in ``--dir`` (default /dev/shm: no disk, so the figures are the copies,
checksums and bookkeeping). Each of ``--repeat`` repetitions times, in alternating order:

- ``accel.save_state(dir, model=model)`` (CRC32 of every byte, fsync, manifest, atomic
  rename), then ``accel.load_state`` into the same model; the directory is then removed;
- ``safetensors.torch.save_file(model.state_dict(), file)``, then
  ``model.load_state_dict(load_file(file))`` (into the same model, as ``load_state`` does:
  ``load_file`` alone maps the file and copies nothing); removed.

Only one copy is ever in the directory (RAM: the model, one checkpoint and the loaded copy).
Small checkpoints are timed more often (``--repeat`` x 1 GB / size, at most 5x, at least
``--repeat``): their times are short and the machine's noise larger. Per size: the median time
of each (and the save's process CPU time, ``save_cpu_ratio``: less disturbed by other work on
the machine than the wall time), and ``save_ratio`` = accel save / safetensors save paired
per repetition (median; judged: <= 1.1 at every size), ``load_ratio`` likewise.

``checkpoint_ranks`` — for 1, 2 and 4 gloo processes (``--ranks``) under
``accel.distributed(strategy="fsdp")`` (one process: nothing sharded, one piece): a model of
``--rank-gb`` GB (8 layers) with AdamW state after one step (3x the weights), each rank
writing its pieces with ``save_state`` and reading them back with ``load_state``; total GB/s =
the state's bytes / the slowest rank's time (barrier to end of the call), median of
``--repeat``.

Usage:
    python bench/curves_checkpoint.py                           # full quality (~3 min)
    python bench/curves_checkpoint.py --sizes 0.001 0.004 --rank-gb 0.002 --repeat 1 \
        --json-out -                                            # smoke
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import quartiles, record, write

import accel
from accel.testing import run_distributed

LAYERS = 8


def _width(gb: float) -> int:
    """The width w of 8 Linear(w, w) layers holding ``gb`` GB of fp32 (weights and biases)."""
    return max(2, int(math.sqrt(gb * 1e9 / 4 / LAYERS)))


def _model(gb: float) -> nn.Module:
    width = _width(gb)
    with torch.no_grad():  # filled without the init's cost (values do not matter to a copy)
        layers = [nn.Linear(width, width, device="meta") for _ in range(LAYERS)]
        model = nn.Sequential(*layers).to_empty(device="cpu")
        for i, p in enumerate(model.parameters()):
            p.fill_(float(i))
    return model


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _size_point(gb: float, root: Path, repeat: int) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    model = _model(gb)
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    times: dict[str, list[float]] = {"accel_save": [], "accel_load": [], "st_save": [],
                                     "st_load": []}
    cpus: dict[str, list[float]] = {"accel_save": [], "st_save": []}
    with accel.distributed():

        def saved(key: str, fn: Any) -> None:
            cpu = time.process_time()
            times[key].append(_timed(fn))
            cpus[key].append(time.process_time() - cpu)

        def run_accel() -> None:
            where = root / "accel"
            saved("accel_save", lambda: accel.save_state(where, model=model))
            times["accel_load"].append(_timed(lambda: accel.load_state(where, model=model)))
            shutil.rmtree(where)

        def run_safetensors() -> None:
            root.mkdir(parents=True, exist_ok=True)
            file = root / "model.safetensors"
            state = model.state_dict()
            saved("st_save", lambda: save_file(state, file))
            times["st_load"].append(_timed(lambda: model.load_state_dict(load_file(file))))
            file.unlink()

        run_accel()  # warm up: first-touch of pages, imports, both paths once
        run_safetensors()
        for values in (*times.values(), *cpus.values()):
            values.clear()
        for rep in range(repeat):
            for run in (run_accel, run_safetensors) if rep % 2 == 0 else (run_safetensors,
                                                                           run_accel):
                gc.collect()
                run()
    save_ratios = [a / s for a, s in zip(times["accel_save"], times["st_save"], strict=True)]
    load_ratios = [a / s for a, s in zip(times["accel_load"], times["st_load"], strict=True)]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"gb": round(nbytes / 1e9, 3), "bytes": nbytes, "width": _width(gb), "repeat": repeat,
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "iqr_s": {k: [round(q, 4) for q in quartiles(v)] for k, v in times.items()},
            "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
            "save_ratio": round(statistics.median(save_ratios), 3),
            "save_ratio_iqr": [round(q, 3) for q in quartiles(save_ratios)],
            "save_ratio_best": round(min(times["accel_save"]) / min(times["st_save"]), 3),
            "load_ratio": round(statistics.median(load_ratios), 3),
            "save_cpu_s": {k: round(statistics.median(v), 4) for k, v in cpus.items()},
            "save_cpu_ratio": round(statistics.median(
                [a / b for a, b in zip(cpus["accel_save"], cpus["st_save"], strict=True)]), 3)}


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def rank_point(gb: float, root: str, repeat: int) -> dict[str, Any]:
    """save_state / load_state of an FSDP model + AdamW on this mesh (every rank)."""
    torch.set_num_threads(1)
    with accel.distributed(strategy="fsdp"):
        width = _width(gb)
        torch.manual_seed(0)
        model = accel.prepare_model(nn.Sequential(*[nn.Linear(width, width)
                                                    for _ in range(LAYERS)]))
        opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad()
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() * 4 * 3
                    for p in model.parameters())
        saves, loads = [], []
        for rep in range(repeat + 1):  # the first is a warm-up
            where = Path(root) / f"r{rep}"
            dist.barrier()
            start = time.perf_counter()
            accel.save_state(where, model=model, optimizer=opt)
            save = _slowest(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            accel.load_state(where, model=model, optimizer=opt)
            load = _slowest(time.perf_counter() - start)
            if rep:
                saves.append(save)
                loads.append(load)
            dist.barrier()
            if rep and dist.get_rank() == 0:  # the previous one: no longer mapped
                shutil.rmtree(Path(root) / f"r{rep - 1}", ignore_errors=True)
        total = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(total)
    return {"state_bytes": int(total.item()), "save_s": saves, "load_s": loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="*", default=[0.1, 0.5, 1.6, 4.0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--rank-gb", type=float, default=0.25,
                        help="weights per model for the ranks curve (its state is 3x)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="where the files go (a tmpfs)")
    parser.add_argument("--json-out", default=None,
                        help="directory for the curve files (default bench/curves; - prints only)")
    args = parser.parse_args()
    curves = []
    base = Path(tempfile.mkdtemp(prefix="accel-curves-ckpt-", dir=args.dir))
    try:
        sizes = []
        for gb in args.sizes:
            repeat = max(args.repeat, min(5 * args.repeat, round(args.repeat / max(gb, 1e-9))))
            sizes.append(_size_point(gb, base / "size", repeat))
            gc.collect()  # the model of this size is gone before the next is made
            shutil.rmtree(base / "size", ignore_errors=True)
        if sizes:
            curves.append(record(
                "checkpoint_size", "save_state / load_state vs safetensors, one process, tmpfs",
                ("GB of tensors", "log"), ("seconds", "log"),
                [{"name": name, "points": [[p["gb"], p["median_s"][key]] for p in sizes],
                  "spread": [p["iqr_s"][key] for p in sizes]}
                 for name, key in (("accel save (save_state)", "accel_save"),
                                   ("safetensors save (save_file)", "st_save"),
                                   ("accel load (load_state)", "accel_load"),
                                   ("safetensors load (load_file)", "st_load"))],
                [{"name": "save ratio (accel / safetensors)",
                  "points": [[p["gb"], p["save_ratio"]] for p in sizes],
                  "spread": [p["save_ratio_iqr"] for p in sizes]},
                 {"name": "load ratio (accel / safetensors)",
                  "points": [[p["gb"], p["load_ratio"]] for p in sizes]}],
                points=sizes, dir=args.dir, derived_label="ratio (accel / safetensors)",
                goal="save_ratio <= 1.1 at every size",
                goal_met=all(p["save_ratio"] <= 1.1 for p in sizes),
            ))
        ranks = []
        for world in args.ranks:
            root = base / f"ranks{world}"
            root.mkdir()
            out = run_distributed(rank_point, args.rank_gb, str(root), args.repeat,
                                  world_size=world, timeout=1800)[0]
            shutil.rmtree(root, ignore_errors=True)
            gbytes = out["state_bytes"] / 1e9
            save_rates = [gbytes / s for s in out["save_s"]]
            load_rates = [gbytes / s for s in out["load_s"]]
            ranks.append({"ranks": world, "state_gb": round(gbytes, 3),
                          "save_s": round(statistics.median(out["save_s"]), 4),
                          "load_s": round(statistics.median(out["load_s"]), 4),
                          "save_gb_s": round(statistics.median(save_rates), 3),
                          "load_gb_s": round(statistics.median(load_rates), 3),
                          "save_gb_s_iqr": [round(q, 3) for q in quartiles(save_rates)],
                          "load_gb_s_iqr": [round(q, 3) for q in quartiles(load_rates)]})
        if ranks:
            curves.append(record(
                "checkpoint_ranks",
                f"FSDP save_state / load_state, {ranks[0]['state_gb']} GB state (weights + "
                "AdamW), tmpfs", ("ranks writing pieces", "log"), ("total GB/s", "linear"),
                [{"name": f"{what}_state", "points": [[p["ranks"], p[f"{what}_gb_s"]]
                                                       for p in ranks],
                  "spread": [p[f"{what}_gb_s_iqr"] for p in ranks]}
                 for what in ("save", "load")],
                points=ranks, dir=args.dir, repeat=args.repeat,
            ))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    write(curves, args.json_out)


if __name__ == "__main__":
    main()
