"""The ``trackio`` tracker against the real package: trackio's local store, read back with
trackio's own ``SQLiteStorage`` and ``Api``. trackio fixes its store directory (``TRACKIO_DIR``)
when it is imported, so the loop runs in a fresh interpreter with ``TRACKIO_DIR`` in
``tmp_path`` and the same socket guard as the other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ci_extra

_BODY = textwrap.dedent(
    """
    import ipaddress, json, socket, sys
    from pathlib import Path
    refused = []
    connect, lookup = socket.socket.connect, socket.getaddrinfo
    def local(host):
        if isinstance(host, (str, bytes)) and not isinstance(host, str):
            return True
        if host in (None, "", "localhost"):
            return True
        try:
            return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
        except ValueError:
            return False
    def guarded_connect(self, address):
        if isinstance(address, tuple) and not local(address[0]):
            refused.append(repr(address))
            raise ConnectionRefusedError(address)
        return connect(self, address)
    def guarded_lookup(host, *args, **kwargs):
        if not local(host):
            refused.append(repr(host))
            raise socket.gaierror(socket.EAI_NONAME, host)
        return lookup(host, *args, **kwargs)
    socket.socket.connect, socket.getaddrinfo = guarded_connect, guarded_lookup

    import accel
    from accel.testing import fake_state
    project = Path(sys.argv[1])
    with fake_state(rank=1, world_size=2), accel.tracking(project, log_with="trackio"):
        accel.log({"loss": 1.0}, step=0)
        other_rank = accel.get_tracker("trackio")
    def loop(name, steps, fail=False):
        with accel.tracking(project, log_with="trackio", config={"lr": 0.1, "path": Path("d")},
                            run_name=name):
            for step in steps:
                accel.log({"loss": 1.0 / (step + 1), "eval": {"acc": step / 4}}, step=step)
            accel.log({"phase": "eval"}, step=steps[-1] + 1)
            native = type(accel.get_tracker("trackio")).__module__
            if fail:
                raise RuntimeError("boom")
        return native
    native = loop("t1", [0, 1, 2])
    try:
        loop("failed", [0, 1], fail=True)
    except RuntimeError:
        pass
    loop("t1", [10, 11])  # the same run name continues the run
    from trackio.sqlite_storage import SQLiteStorage
    import trackio
    out = {
        "other_rank": other_rank, "native": native, "refused": refused,
        "runs": sorted(SQLiteStorage.get_runs("proj")),
        "logs": {r: SQLiteStorage.get_logs("proj", r) for r in ("t1", "failed")},
        "config": {r.name: r.config for r in trackio.Api().runs("proj")},
        "alerts": [a.get("title") for a in SQLiteStorage.get_alerts("proj")],
    }
    print("RESULT " + json.dumps(out, default=str))
    """
)


def test_trackio_local_store_holds_the_runs(tmp_path: Path) -> None:
    pytest.importorskip("trackio", reason="extra accel[trackio] not installed")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "HF_TOKEN")}
    env.update(TRACKIO_DIR=str(tmp_path / "store"), HOME=str(tmp_path))
    script = tmp_path / "body.py"
    script.write_text(_BODY)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "proj")], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=240, check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["refused"] == []
    assert out["other_rank"] is None
    assert out["native"].startswith("trackio")
    assert out["runs"] == ["failed", "t1"]  # one run per run name
    t1 = out["logs"]["t1"]
    assert [(row["step"], row["loss"]) for row in t1 if "loss" in row] == [
        (0, 1.0), (1, 0.5), (2, 1 / 3), (10, 1 / 11), (11, 1 / 12)
    ]
    assert [row["eval/acc"] for row in t1 if "eval/acc" in row] == [0.0, 0.25, 0.5, 2.5, 2.75]
    phases = [(row["step"], row["phase"]) for row in t1 if "phase" in row]
    assert phases == [(3, "eval"), (12, "eval")]
    assert len([row for row in out["logs"]["failed"] if "loss" in row]) == 2  # kept
    assert {k: out["config"]["t1"][k] for k in ("lr", "path")} == {"lr": 0.1, "path": "d"}
    assert out["alerts"] == ["the tracking block raised"]  # only the failed run
