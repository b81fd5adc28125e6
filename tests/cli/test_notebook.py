"""notebook_launcher / debug_launcher: from a plain Python process, and their refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.errors import ConfigError, LaunchError
from accel.launch import debug_launcher, notebook_launcher
from tests.cli._helpers import clean_env

# What a notebook cell would hold: a training function defined in __main__ (fork: not pickled).
NOTEBOOK = '''
import json, os
import torch
import accel
from accel.launch import debug_launcher, notebook_launcher

def training_loop(lr, steps):
    with accel.distributed() as st:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        data = torch.randn(8, 3, generator=torch.Generator().manual_seed(st.rank))
        for _ in range(steps):
            loss = ddp(data).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        weights = accel.gather_object(model.weight.detach().tolist())
        return {"rank": st.rank, "world": st.world_size, "mp": st.mixed_precision,
                "same": all(w == weights[0] for w in weights), "backend": st.backend}

def failing():
    with accel.distributed() as st:
        if st.rank == 1:
            raise KeyError("missing column on rank 1")
        accel.wait_for_everyone()

if __name__ == "__main__":
    out = notebook_launcher(training_loop, (0.1, 3), num_processes=2, mixed_precision="bf16")
    print("NOTEBOOK " + json.dumps(out), flush=True)
    print("DEBUG " + json.dumps(debug_launcher(lambda: training_loop(0.1, 1))), flush=True)
    try:
        notebook_launcher(failing, num_processes=2)
    except accel.AccelError as error:
        print("FAILED " + json.dumps(str(error)), flush=True)
    print("LEFT " + json.dumps(sorted(k for k in os.environ if k.startswith(("TORCHELASTIC",
          "RANK", "WORLD_SIZE", "ACCEL_", "TORCH_DISABLE")))), flush=True)
'''


@pytest.mark.ci_extra
@pytest.mark.slow
def test_notebook_launcher_from_a_plain_python_process(tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(tmp_path),
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stdout
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines()
             if line.split(" ", 1)[0] in ("NOTEBOOK", "DEBUG", "FAILED", "LEFT")}
    notebook = json.loads(lines["NOTEBOOK"])
    assert [r["rank"] for r in notebook] == [0, 1]
    assert all(r["world"] == 2 and r["mp"] == "bf16" and r["same"] for r in notebook)
    assert all(r["backend"] == "gloo" for r in notebook)
    debug = json.loads(lines["DEBUG"])
    assert [(r["rank"], r["mp"], r["backend"]) for r in debug] == [(0, "no", "gloo"),
                                                                  (1, "no", "gloo")]
    failed = json.loads(lines["FAILED"])
    assert "rank 1 raised" in failed
    assert "KeyError: 'missing column on rank 1'" in failed
    assert "in failing" in failed
    assert json.loads(lines["LEFT"]) == []  # the notebook's environment is left as it was


def test_refuses_when_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchError, match="CUDA is already initialised") as info:
        notebook_launcher(print, num_processes=2)
    assert "Restart the kernel" in str(info.value)


def test_refuses_inside_a_launched_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for launcher in (notebook_launcher, debug_launcher):
        with pytest.raises(LaunchError, match="rank 1 of 2"):
            launcher(print)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mixed_precision": "fp32"}, "mixed_precision='fp32'"),
        ({"num_processes": 0}, "num_processes=0"),
        ({"num_nodes": 2, "node_rank": 2}, "node_rank=2"),
        ({"max_restarts": -1}, "max_restarts=-1"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        notebook_launcher(print, **kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
def test_notebook_launcher_in_a_jupyter_kernel(tmp_path: Path) -> None:
    """Skipped unless jupyter_client and ipykernel are installed (they are not dependencies)."""
    manager = pytest.importorskip("jupyter_client.manager")
    pytest.importorskip("ipykernel")
    kernel, client = manager.start_new_kernel(kernel_name="python3", env=clean_env(tmp_path),
                                              cwd=str(tmp_path))
    output: list[str] = []

    def hook(message: dict[str, Any]) -> None:
        if message["msg_type"] == "stream":
            output.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            output.append(f"ERROR {message['content']['ename']}: {message['content']['evalue']}")

    cells = [
        "import torch, accel\n"
        "from accel.launch import notebook_launcher\n"
        "def training_loop(scale):\n"
        "    with accel.distributed() as st:\n"
        "        return accel.gather(torch.tensor([st.rank * scale])).tolist()\n",
        "print('FIRST', notebook_launcher(training_loop, (5,), num_processes=2))",
        "print('AGAIN', notebook_launcher(training_loop, (7,), num_processes=2))",
    ]
    try:
        statuses = [client.execute_interactive(cell, timeout=120, output_hook=hook)["content"][
            "status"] for cell in cells]
    finally:
        client.stop_channels()
        kernel.shutdown_kernel(now=True)
    text = "".join(output)
    assert statuses == ["ok", "ok", "ok"], text
    assert "FIRST [[0, 5], [0, 5]]" in text
    assert "AGAIN [[0, 7], [0, 7]]" in text  # a second launch from the same kernel works
