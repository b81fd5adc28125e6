"""Big-model loading: accel vs Accelerate's ``load_checkpoint_and_dispatch``; prints JSON.

Model: 24 x ``Linear(4096, 4096)`` in an ``nn.Sequential`` (1.611 GB fp32), written once as 4
safetensors shards plus ``model.safetensors.index.json`` (``accel.save_model`` with a
``max_shard_size``) and once as one ``torch.save`` file. Each measurement runs in a fresh
child process (so its peak RSS is its own): build the model under ``init_empty_weights``,
``load_checkpoint_and_dispatch(model, checkpoint, device_map="auto", ...)``, then two forwards
of a small batch under ``torch.no_grad()``. Reported per case: load time, first and second
forward time, load + first forward (a load that maps the files lazily pays for reading them
in the first forward), peak RSS (``VmHWM`` at the end of the child: it includes the ~0.2 GB
of an imported torch; ``ru_maxrss`` is not used, it keeps the parent's RSS from before the
exec), RSS before loading, RSS anon/file at the end, the bytes written to the offload folder,
the device map's placement counts, and the max abs difference of both outputs from the fully
loaded model's.

Cases:
  (a) the sharded safetensors directory, ``device_map="auto"`` (everything fits in RAM);
  (b) the single torch file, ``device_map="auto"``;
  (c) the sharded safetensors directory, ``max_memory={"cpu": "400MB"}`` and an
      ``offload_folder``: most layers run from disk.
Yardstick for (b): reading the torch file once, whole, into a reused 16 MiB buffer (what
``cat file > /dev/null`` does), in this process, median of 3 (the same for the shards is
reported too, for reference).

Page cache: by default every measurement is hot (the files are read once just before each
child starts, so all are in the page cache; the yardstick read is hot too). ``--cold`` (root
only) instead drops the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``) before each
child and before each yardstick read.

If ``accelerate`` is importable, its ``load_checkpoint_and_dispatch`` is measured on the same
files in the same run (children alternate between the two libraries) and the ratios
accel / Accelerate are printed, with the goals: (a) load time and peak RSS <= Accelerate's;
(b) load time <= 1.2 x the read-once time; (c) load time <= 0.5 x Accelerate's, both forwards
no slower, peak RSS <= Accelerate's. Every output must match the full model to 1e-6.

Usage:
    python bench/big_model.py                              # full size, 3 repeats
    python bench/big_model.py --layers 2 --size 256 --no-accelerate   # smoke run, seconds
    python bench/big_model.py --profile c                  # cProfile of case (c) to stderr
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

FULL_LAYERS, FULL_SIZE = 24, 4096
CASES = {
    "a": "sharded safetensors, device_map='auto', everything in RAM",
    "b": "one torch.save file, device_map='auto'",
    "c": "sharded safetensors, max_memory cpu budget + offload_folder (disk offload)",
}
FIELDS = ("load_s", "forward1_s", "forward2_s", "load_plus_forward1_s", "peak_rss_mb")
ATOL = 1e-6


def _layer_bytes(size: int) -> int:
    return (size * size + size) * 4


def _default_budget(layers: int, size: int) -> int | str:
    """``max_memory["cpu"]`` of case (c): "400MB" at full size (4 of the 24 layers fit next to
    the one layer being run from disk); for smaller models the same shape: room for one layer
    plus about a quarter of them."""
    if (layers, size) == (FULL_LAYERS, FULL_SIZE):
        return "400MB"
    return _layer_bytes(size) * (1 + layers // 4) + _layer_bytes(size) // 2


def build(layers: int, size: int) -> Any:
    """The benchmark model: ``layers`` x ``Linear(size, size)`` in a Sequential."""
    from torch import nn

    return nn.Sequential(*(nn.Linear(size, size) for _ in range(layers)))


def _batch(batch: int, size: int) -> Any:
    import torch

    return torch.randn(batch, size, generator=torch.Generator().manual_seed(1))


def _proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _dir_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------- child: one measurement


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import importlib

    import torch
    from safetensors.torch import load_file

    library = importlib.import_module(spec["lib"])  # accel, or accelerate (only that one)
    init_empty_weights = library.init_empty_weights
    load_checkpoint_and_dispatch = library.load_checkpoint_and_dispatch

    x = _batch(spec["batch"], spec["size"])
    reference = load_file(spec["reference"])["out"]
    kwargs: dict[str, Any] = {"device_map": "auto"}
    offload = Path(spec["offload_folder"]) if spec["offload_folder"] else None
    if spec["max_memory"] is not None:
        kwargs["max_memory"] = spec["max_memory"]
    if offload is not None:
        kwargs["offload_folder"] = str(offload)
    profiler = None
    if spec["profile"]:
        import cProfile

        profiler = cProfile.Profile()
    gc.collect()
    before = _proc_status()
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    with init_empty_weights():
        model = build(spec["layers"], spec["size"])
    model = load_checkpoint_and_dispatch(model, spec["checkpoint"], **kwargs)
    load_s = time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        out1 = model(x)
        forward1_s = time.perf_counter() - start
        start = time.perf_counter()
        out2 = model(x)
        forward2_s = time.perf_counter() - start
    if profiler is not None:
        import pstats

        profiler.disable()
        print(f"---- profile: {spec['lib']} case {spec['case']} (load + 2 forwards)",
              file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    diff = max((out1 - reference).abs().max().item(), (out2 - reference).abs().max().item())
    end = _proc_status()
    device_map = getattr(model, "hf_device_map", None) or {}
    return {
        "load_s": load_s,
        "forward1_s": forward1_s,
        "forward2_s": forward2_s,
        # weights mapped lazily are read in by the first forward: this sum is the fair total
        "load_plus_forward1_s": load_s + forward1_s,
        # VmHWM, not ru_maxrss: the latter keeps the parent's RSS from before the exec
        "peak_rss_mb": end["VmHWM"] / 2**20,
        "rss_before_load_mb": before["VmRSS"] / 2**20,
        "rss_anon_end_mb": end["RssAnon"] / 2**20,
        "rss_file_end_mb": end["RssFile"] / 2**20,
        "offload_folder_mb": _dir_bytes(offload) / 2**20 if offload else 0.0,
        "placement": dict(Counter(str(v) for v in device_map.values())),
        "max_abs_diff": diff,
    }


# ---------------------------------------------------------------- parent: files and runs


def _on_tmpfs(path: Path) -> bool:
    best, fstype = "", ""
    resolved = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount = parts[1]
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(
                mount
            ) > len(best):
                best, fstype = mount, parts[2]
    return fstype in ("tmpfs", "ramfs")


def _work_dir(requested: str | None) -> Path:
    if requested:
        path = Path(requested)
        path.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="accel-big-model-", dir=path))
    base = Path(tempfile.gettempdir())
    if _on_tmpfs(base):  # a RAM disk would hide the reading cost: use the repository's disk
        base = Path(__file__).resolve().parents[2]
    return Path(tempfile.mkdtemp(prefix="accel-big-model-", dir=base))


def _write_files(root: Path, layers: int, size: int, shards: int, batch: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    import accel

    torch.manual_seed(0)
    with torch.no_grad():
        model = build(layers, size)
        reference = model(_batch(batch, size))
    per_shard = -(-layers // shards)
    limit = per_shard * _layer_bytes(size) + _layer_bytes(size) // 2
    sharded = root / "sharded"
    start = time.perf_counter()
    accel.save_model(model, sharded, max_shard_size=limit)
    save_model_s = time.perf_counter() - start
    torch_file = root / "model.pt"
    start = time.perf_counter()
    torch.save(model.state_dict(), torch_file)
    torch_save_s = time.perf_counter() - start
    save_file({"out": reference.contiguous()}, str(root / "reference.safetensors"))
    written = sorted(p.name for p in sharded.iterdir())
    del model
    gc.collect()
    return {
        "sharded_files": written,
        "shard_count": sum(name.endswith(".safetensors") for name in written),
        "max_shard_size": limit,
        "save_model_s": round(save_model_s, 3),
        "torch_save_s": round(torch_save_s, 3),
        "torch_file_mb": round(torch_file.stat().st_size / 2**20, 1),
    }


def _read_once(path: Path) -> float:
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - start


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _warm(paths: list[Path]) -> None:
    for path in paths:
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                _read_once(file)


def _run_child(spec: dict[str, Any], cold: bool, warm: list[Path]) -> dict[str, Any]:
    if spec["offload_folder"]:
        shutil.rmtree(spec["offload_folder"], ignore_errors=True)
    if cold:
        _drop_caches()
    else:
        _warm(warm)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True, text=True, env=env, check=False,
    )
    if spec["profile"]:
        sys.stderr.write(done.stderr)
    if spec["offload_folder"]:
        shutil.rmtree(spec["offload_folder"], ignore_errors=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"]}
    out: dict[str, Any] = {}
    for key, value in good[0].items():
        if isinstance(value, float):
            out[key] = round(statistics.median(r[key] for r in good), 4)
    out["max_abs_diff"] = max(r["max_abs_diff"] for r in good)
    out["placement"] = good[0]["placement"]
    out["runs"] = len(good)
    if len(good) < len(runs):
        out["failed_runs"] = [r["error"] for r in runs if "error" in r]
    return out


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def _goals(results: dict[str, dict[str, Any]], read_once_s: float) -> dict[str, dict[str, Any]]:
    def get(lib: str, case: str) -> dict[str, Any] | None:
        value = results.get(lib, {}).get(case)
        return None if value is None or "error" in value else value

    goals: dict[str, dict[str, Any]] = {}
    a, ref_a = get("accel", "a"), get("accelerate", "a")
    goals["a"] = {
        "goal": "load_s <= Accelerate's and peak_rss <= Accelerate's",
        "result": _verdict(
            None if a is None or ref_a is None
            else a["load_s"] <= ref_a["load_s"] and a["peak_rss_mb"] <= ref_a["peak_rss_mb"]
        ),
    }
    b = get("accel", "b")
    goals["b"] = {
        "goal": "load_s <= 1.2 x read-once time of the torch file",
        "limit_s": round(1.2 * read_once_s, 4),
        "result": _verdict(None if b is None else b["load_s"] <= 1.2 * read_once_s),
    }
    c, ref_c = get("accel", "c"), get("accelerate", "c")
    goals["c"] = {
        "goal": "load_s <= 0.5 x Accelerate's, forwards no slower, peak_rss <= Accelerate's",
        "result": _verdict(
            None if c is None or ref_c is None
            else c["load_s"] <= 0.5 * ref_c["load_s"]
            and c["forward1_s"] <= ref_c["forward1_s"]
            and c["forward2_s"] <= ref_c["forward2_s"]
            and c["peak_rss_mb"] <= ref_c["peak_rss_mb"]
        ),
    }
    checked = [r for lib in results.values() for r in lib.values() if "error" not in r]
    failed = [(lib, case) for lib, cases in results.items() for case, r in cases.items()
              if "error" in r]
    goals["correct"] = {
        "goal": f"every output matches the full model to {ATOL} and no run failed",
        "result": _verdict(
            None if not checked
            else not failed and all(r["max_abs_diff"] <= ATOL for r in checked)
        ),
    }
    return goals


def _accelerate_version() -> str | None:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        return None
    from importlib.metadata import version

    return version("accelerate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=FULL_LAYERS)
    parser.add_argument("--size", type=int, default=FULL_SIZE)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="children per library and case; figures are medians")
    parser.add_argument("--offload-budget", default=None,
                        help="max_memory['cpu'] of case (c) (default: 400MB at full size)")
    parser.add_argument("--cases", default="abc", help="which of a, b, c to run")
    parser.add_argument("--dir", default=None,
                        help="parent of the temporary directory (default: the temp dir, unless "
                             "it is a RAM disk); removed at the end")
    parser.add_argument("--no-accelerate", action="store_true",
                        help="measure accel only, even if accelerate is installed")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before each measurement (root only)")
    parser.add_argument("--profile", default="",
                        help="cases whose children run under cProfile (printed to stderr)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return
    if args.cold and os.geteuid() != 0:
        parser.error("--cold needs root (it writes /proc/sys/vm/drop_caches)")
    cases = [c for c in "abc" if c in args.cases]

    import torch

    accelerate_version = None if args.no_accelerate else _accelerate_version()
    libs = ["accel"] + (["accelerate"] if accelerate_version else [])
    total = args.layers * _layer_bytes(args.size)
    budget: int | str = _default_budget(args.layers, args.size)
    if args.offload_budget:
        budget = int(args.offload_budget) if args.offload_budget.isdigit() else args.offload_budget
    root = _work_dir(args.dir)
    report: dict[str, Any] = {
        "model": f"{args.layers} x Linear({args.size}, {args.size}) fp32",
        "bytes": total,
        "gb": round(total / 1e9, 3),
        "batch": args.batch,
        "repeats": args.repeats,
        "page_cache": "cold (dropped before each measurement)" if args.cold else "hot",
        "offload_budget": budget,
        "work_dir_tmpfs": _on_tmpfs(root),
        "torch": torch.__version__,
        "accelerate": accelerate_version,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "cases": {c: CASES[c] for c in cases},
    }
    try:
        report["files"] = _write_files(root, args.layers, args.size, args.shards, args.batch)
        sharded, torch_file = root / "sharded", root / "model.pt"
        reads: dict[str, list[float]] = {"torch_file": [], "shards": []}
        for _ in range(3):
            if args.cold:
                _drop_caches()
            reads["torch_file"].append(_read_once(torch_file))
            if args.cold:
                _drop_caches()
            start = time.perf_counter()
            _warm([sharded])
            reads["shards"].append(time.perf_counter() - start)
        read_once_s = statistics.median(reads["torch_file"])
        report["read_once_torch_file_s"] = round(read_once_s, 4)
        report["read_once_shards_s"] = round(statistics.median(reads["shards"]), 4)
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {lib: {} for lib in libs}
        for case in cases:
            checkpoint = torch_file if case == "b" else sharded
            for _ in range(args.repeats):
                for lib in libs:
                    spec = {
                        "lib": lib, "case": case, "layers": args.layers, "size": args.size,
                        "batch": args.batch, "checkpoint": str(checkpoint),
                        "reference": str(root / "reference.safetensors"),
                        "max_memory": {"cpu": budget} if case == "c" else None,
                        "offload_folder": str(root / f"offload-{lib}") if case == "c" else None,
                        "profile": case in args.profile,
                    }
                    runs[lib].setdefault(case, []).append(
                        _run_child(spec, args.cold, [checkpoint])
                    )
        results = {lib: {case: _summary(r) for case, r in by_case.items()}
                   for lib, by_case in runs.items()}
        report["results"] = results
        if "accelerate" in results:
            report["ratios_accel_over_accelerate"] = {
                case: {
                    key: round(results["accel"][case][key] / results["accelerate"][case][key], 3)
                    for key in FIELDS
                    if "error" not in results["accel"][case]
                    and "error" not in results["accelerate"][case]
                }
                for case in cases
            }
        report["goals"] = _goals(results, read_once_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2))
    for name, goal in report.get("goals", {}).items():
        print(f"goal {name}: {goal['result']}  ({goal['goal']})", file=sys.stderr)


if __name__ == "__main__":
    main()
