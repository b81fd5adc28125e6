"""Steady-state step cost of the liveness watch (issue 39, part 3); prints JSON.

Two processes on this host pose as two machines: this script hosts the job's TCP store as
torch's elastic agent does and starts each worker with the variables an agent gives the one
worker of its machine (``RANK``, ``GROUP_RANK`` = rank, ``LOCAL_WORLD_SIZE=1``,
``GROUP_WORLD_SIZE=2``, ``TORCHELASTIC_USE_AGENT_STORE=True``...), so ``accel.distributed()``
creates the gloo group over that store and reads ``num_nodes == 2``. The workers get this
environment without its ``ACCEL_*`` and ``TORCHELASTIC_*`` variables, and ``OMP_NUM_THREADS=1``.

Each worker trains through accel (``prepare_model`` + ``prepare_optimizer``: DDP over gloo,
``accumulate`` + ``backward``) and times steps in alternating paired windows, in the same
process group, with the watch running and not running. The block is entered with
``liveness_timeout=0`` (its own watch off) and the bench turns the watch on for each "on"
window with ``accel.core.liveness.start_watch`` (the call ``distributed()`` makes: a
``Watch`` with its own clone of the store, its two daemon threads, the real bounds) and off
after it with ``watch.stop(clean=True)`` (what the block's exit does). Before an "on" window is
timed, the watch has made its first round (it read the ranks' records and heard the other
rank): that one-off round is not steady state. An "off" window waits as long first, polled
alike (a rank idle for a second runs its next steps faster on a shared machine: without it the
"on" windows came out 5% faster). Between windows a barrier lines the ranks up. ``--control``
is an A/A run: the "on" windows start no watch either, which shows the method's own noise.

Proof that the watch ran: every "on" window starts only once the watch's own beat counter
moved and it heard the other rank; the rounds it made inside the timed window are counted
from that counter (``Watch.hearing.counts``); the watch's threads are alive in every "on"
window and none is in an "off" window. Any of these failing ends the run with an error.

Rows: ``default`` (the default bounds, interval 1 s, timeout 10 s, the quicktour Linear
10->5), ``stress`` (interval 0.05 s: an upper bound) and ``big`` (default bounds, a 4.2M
parameter MLP, so the all-reduce is real). Unless ``--steps`` is given, a row's windows are
sized to last ``--window-intervals`` heartbeat intervals (at least 0.5 s), since a window
shorter than an interval may hold no round at all.

Per row: median step time off/on (rank 0, microseconds), the median of the paired ratios
on/off and their IQR, the windows and steps per window, the watch's rounds per second inside
the timed windows (each round is two store requests: one ``add``, one ``multi_get``) against
the 1/interval it aims at, and rank 1's ratio.

Usage:
    python bench/liveness.py                                   # ~2 minutes on 2 cores
    python bench/liveness.py --rows stress --windows 2 --json-out /tmp/liveness.json
    python bench/liveness.py --rows default --windows 20 --control   # A/A: no watch at all
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import loadavg

ROWS: dict[str, dict[str, Any]] = {
    "default": {"interval": 1.0, "timeout": 10.0, "model": "small"},
    "stress": {"interval": 0.05, "timeout": 10.0, "model": "small"},
    "big": {"interval": 1.0, "timeout": 10.0, "model": "big"},
}
MIN_WINDOW_S = 0.5
REQUESTS_PER_ROUND = 2  # Watch.exchange: store.add (the stamp) + store.multi_get (the counters)
_THREAD_PREFIX = "accel-liveness-"


# -- in each worker -------------------------------------------------------------------------

def _model_and_data(kind: str) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "small":
        return nn.Linear(10, 5), (torch.randn(16, 100, 10), torch.randn(16, 100, 5))
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
    return model, (torch.randn(4, 32, 1024), torch.randn(4, 32, 1024))


def _loop(model: Any, opt: Any, data: Any, steps: int) -> float:
    """``steps`` training steps through accel; their wall seconds."""
    import torch
    from torch import nn

    import accel

    xs, ys = data
    loss_fn = nn.MSELoss()
    start = time.perf_counter()
    for i in range(steps):
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        with accel.accumulate(model):
            loss: torch.Tensor = loss_fn(model(x), y)
            accel.backward(loss)
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - start


def _watch_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(_THREAD_PREFIX) and t.is_alive()]


def _agree_max(value: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _poll(interval: float) -> float:
    return min(0.01, interval / 5)


def _warm_watch(watch: Any, rank: int, peer: int, interval: float) -> None:
    """Wait until the watch made a round that read the ranks' records and heard ``peer``."""
    deadline = time.monotonic() + interval + 15.0
    while time.monotonic() < deadline:
        counts = watch.hearing.counts
        if watch.machines and counts.get(rank, 0) >= 2 and counts.get(peer, 0) >= 1:
            return
        time.sleep(_poll(interval))
    raise RuntimeError(
        f"rank {rank}: the liveness watch started but made no round that heard rank {peer} "
        f"within {interval + 15.0:g}s (hearing {watch.hearing!r}): it is not running"
    )


def _on_window(st: Any, bounds: Any, model: Any, opt: Any, data: Any,
               steps: int) -> dict[str, float]:
    """One timed window with a watch running: its seconds, the watch's rounds (own and the
    other rank's) inside it, the pause before it, and the watch's rounds per running second."""
    import torch.distributed as dist

    from accel.core.liveness import start_watch

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "0"))
    started = time.perf_counter()
    watch = start_watch(st, bounds, store_host=host, store_port=port)
    if watch is None:
        raise RuntimeError(f"rank {st.rank}: start_watch started no watch (num_nodes="
                           f"{st.num_nodes}, world_size={st.world_size}, bounds={bounds})")
    peer = 1 - st.rank
    try:
        _warm_watch(watch, st.rank, peer, bounds.interval)
        pause = time.perf_counter() - started
        dist.barrier()
        before = dict(watch.hearing.counts)
        seconds = _loop(model, opt, data, steps)
        after = dict(watch.hearing.counts)
        alive = _watch_threads()
        running = time.perf_counter() - started
    finally:
        watch.stop(clean=True)
    if len(alive) != 2:
        raise RuntimeError(f"rank {st.rank}: the watch's threads were not both alive at the "
                           f"end of an 'on' window: {alive}")
    return {"seconds": seconds, "own": after[st.rank] - before[st.rank],
            "peer": after[peer] - before[peer], "pause": pause,
            "running_rounds": after[st.rank] - 1, "running_s": running}


def _off_window(st: Any, model: Any, opt: Any, data: Any, steps: int, pause: float,
                poll: float) -> float:
    """One timed window with no watch, after a pause like an 'on' window's start (the same
    length, polled alike: a rank that idled a second runs its next steps faster here)."""
    import torch.distributed as dist

    end = time.perf_counter() + pause
    while time.perf_counter() < end:
        time.sleep(min(poll, max(0.0, end - time.perf_counter())))
    dist.barrier()
    left = _watch_threads()
    if left:
        raise RuntimeError(f"rank {st.rank}: watch threads running in an 'off' window: {left}")
    return _loop(model, opt, data, steps)


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def measure_row(name: str, windows: int, steps: int | None, window_intervals: float,
                control: bool = False) -> dict[str, Any]:
    """Time one row's paired windows (call on every rank, inside ``accel.distributed()``);
    ``control``: the 'on' windows start no watch either (an A/A run: the method's own noise
    and bias)."""
    import torch

    import accel
    from accel.core.env import LaunchEnv
    from accel.core.liveness import liveness_bounds

    row = ROWS[name]
    st = accel.state()
    bounds = liveness_bounds(LaunchEnv(), heartbeat_interval=row["interval"],
                             liveness_timeout=row["timeout"])
    raw_model, data = _model_and_data(row["model"])
    params = sum(p.numel() for p in raw_model.parameters())
    model = accel.prepare_model(raw_model)
    opt = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    probe = 20 if row["model"] == "big" else 400
    _loop(model, opt, data, probe // 4)  # warm up
    window_s = max(window_intervals * bounds.interval, MIN_WINDOW_S)
    if steps is None:
        per_step = _loop(model, opt, data, probe) / probe
        steps = _agree_max(max(1, math.ceil(window_s / per_step)))
    off: list[float] = []
    ons: list[dict[str, float]] = []
    pause = bounds.interval
    for w in range(windows):
        for which in (("on", "off") if w % 2 == 0 else ("off", "on")):
            poll = _poll(bounds.interval)
            if which == "on" and control:
                seconds = _off_window(st, model, opt, data, steps, pause, poll)
                ons.append({"seconds": seconds, "own": 0, "peer": 0, "pause": pause,
                            "running_rounds": 0, "running_s": 1.0})
            elif which == "on":
                ons.append(_on_window(st, bounds, model, opt, data, steps))
                pause = ons[-1]["pause"]
            else:
                off.append(_off_window(st, model, opt, data, steps, pause, poll))
    on = [o["seconds"] for o in ons]
    on_seconds = sum(on)
    rounds = int(sum(o["own"] for o in ons))
    heard = int(sum(o["peer"] for o in ons))
    running_s = sum(o["running_s"] for o in ons)
    if not control and on_seconds >= 3 * bounds.interval and (rounds == 0 or heard == 0):
        raise RuntimeError(
            f"rank {st.rank}, row {name}: {on_seconds:.1f}s of 'on' windows at "
            f"heartbeat_interval={bounds.interval:g}s, but the watch made {rounds} rounds and "
            f"heard {heard} of the other rank's: it did not run"
        )
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    return {
        "heartbeat_interval_s": bounds.interval,
        "liveness_timeout_s": bounds.timeout,
        "model_params": params,
        "windows": windows,
        "steps_per_window": steps,
        "window_s_median": round(statistics.median(off + on), 3),
        "step_us_off": round(statistics.median(off) / steps * 1e6, 2),
        "step_us_on": round(statistics.median(on) / steps * 1e6, 2),
        "ratio_on_off_median": round(statistics.median(ratios), 4),
        "ratio_on_off_p25_p75": [round(q, 4) for q in _quartiles(ratios)],
        "watch": {
            "rounds_in_on_windows": rounds,
            "peer_rounds_heard_in_on_windows": heard,
            "on_seconds": round(on_seconds, 3),
            "rounds_per_s_in_windows": round(rounds / on_seconds, 3) if on_seconds else None,
            "store_requests_per_s_in_windows": (
                round(REQUESTS_PER_ROUND * rounds / on_seconds, 3) if on_seconds else None),
            "rounds_per_s_running": round(sum(o["running_rounds"] for o in ons) / running_s, 3),
            "rounds_per_s_aimed": round(1 / bounds.interval, 3),
            "pause_before_window_s_median": round(statistics.median(o["pause"] for o in ons), 3),
            "every_on_window_warmed": not control,  # else _warm_watch raised
        },
        "control": control,
    }


def worker(config: dict[str, Any], out_path: str) -> None:
    """One rank: all rows inside one ``accel.distributed()`` block; JSON to ``out_path``."""
    import torch

    import accel

    torch.set_num_threads(1)
    with accel.distributed(liveness_timeout=0) as st:
        if st.num_nodes != 2 or st.world_size != 2:
            raise RuntimeError(f"expected 2 machines of 1 rank each, got num_nodes="
                               f"{st.num_nodes}, world_size={st.world_size}")
        if _watch_threads():
            raise RuntimeError("liveness_timeout=0, yet a watch runs: "
                               f"{_watch_threads()}")
        rows = {name: measure_row(name, config["windows"], config["steps"],
                                  config["window_intervals"], config["control"])
                for name in config["rows"]}
    with open(out_path, "w") as f:
        json.dump({"rank": st.rank, "node_rank": st.node_rank, "num_nodes": st.num_nodes,
                   "rows": rows}, f)


# -- the launcher -----------------------------------------------------------------------------

def _agent_env(rank: int, port: int, run_id: str) -> dict[str, str]:
    """What torch's agent on machine ``rank`` gives its one worker (machine 0 hosts the store)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("ACCEL_", "TORCHELASTIC_"))}
    return {
        **env,
        "RANK": str(rank), "LOCAL_RANK": "0", "GROUP_RANK": str(rank), "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
    }


def run(config: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Start the two workers over a store hosted here; each one's report, in rank order."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="accel-liveness-bench-") as tmp, \
            contextlib.ExitStack() as files:
        outs = [os.path.join(tmp, f"{rank}.json") for rank in range(2)]
        logs = [files.enter_context(open(os.path.join(tmp, f"{rank}.log"), "w+"))
                for rank in range(2)]
        procs = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(config),
             outs[rank]], env=_agent_env(rank, store.port, run_id), stdout=logs[rank],
            stderr=subprocess.STDOUT) for rank in range(2)]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(3.0)  # the other rank's error may be the cause: let it report
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            quoted = []
            for rank, log in enumerate(logs):
                log.seek(0)
                quoted.append(f"--- rank {rank} (exit code {procs[rank].returncode}) ---\n"
                              + log.read()[-6000:])
            raise SystemExit(f"bench/liveness.py: ranks {failed} failed (or ran past "
                             f"--timeout {timeout:g}s):\n" + "\n".join(quoted))
        reports = []
        for path in outs:
            with open(path) as f:
                reports.append(json.load(f))
    return reports


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--windows", type=int, default=10, help="paired windows per row")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per window (default: sized per row, --window-intervals)")
    parser.add_argument("--window-intervals", type=float, default=2.0,
                        help="without --steps: a window lasts this many heartbeat intervals "
                             f"(at least {MIN_WINDOW_S}s)")
    parser.add_argument("--control", action="store_true",
                        help="A/A run: the 'on' windows start no watch (the method's noise)")
    parser.add_argument("--json-out", default=None, help="also write the report to this file")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.windows < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--windows and --steps must be >= 1")
    config = {"rows": args.rows, "windows": args.windows, "steps": args.steps,
              "window_intervals": args.window_intervals, "control": args.control}
    import torch

    report: dict[str, Any] = {
        "torch": torch.__version__, "python": sys.version.split()[0],
        "host": socket.gethostname(), "cpus": os.cpu_count(), "loadavg": loadavg(),
        "clock": "wall (time.perf_counter), rank 0", "config": config,
    }
    started = time.monotonic()
    reports = run(config, args.timeout)
    rows = reports[0]["rows"]
    for name, row in rows.items():
        other = reports[1]["rows"][name]
        row["rank1_ratio_on_off_median"] = other["ratio_on_off_median"]
        row["rank1_watch_rounds_per_s_running"] = other["watch"]["rounds_per_s_running"]
    report["num_nodes_seen"] = [r["num_nodes"] for r in reports]
    report["rows"] = rows
    report["seconds"] = round(time.monotonic() - started, 1)
    report["loadavg_after"] = loadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
