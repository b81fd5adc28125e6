"""Fixtures for the tests of the six offline trackers: no credentials, no network."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# credentials and online switches of the trackers (and their hosts): none may be set
_ONLINE_VARIABLES = (
    "COMET_API_KEY", "COMET_WORKSPACE", "COMET_PROJECT_NAME", "COMET_URL_OVERRIDE",
    "CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY", "CLEARML_API_HOST", "CLEARML_WEB_HOST",
    "CLEARML_FILES_HOST", "CLEARML_OFFLINE_MODE", "CLEARML_CONFIG_FILE",
    "DVC_STUDIO_TOKEN", "STUDIO_TOKEN", "DVC_STUDIO_REPO_URL", "DVC_STUDIO_URL",
    "SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_HOST", "SWANLAB_WEB_HOST",
    "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "HF_TOKEN", "WANDB_API_KEY", "AIM_REPO",
)

# what ClearML writes into os.environ itself (its offline mode and process id)
_SET_BY_TRACKERS = (
    "CLEARML_OFFLINE_MODE", "TRAINS_OFFLINE_MODE",
    "CLEARML_PROC_MASTER_ID", "TRAINS_PROC_MASTER_ID",
)


def _is_local(address: Any) -> bool:
    if isinstance(address, str | bytes):  # an AF_UNIX path
        return True
    host = address[0] if isinstance(address, tuple) else address
    if host in (None, "localhost", ""):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """Refuse every connection and name lookup that is not loopback (in this process).

    Also: no tracker credentials in the environment; ``HOME`` (also the working directory)
    and ClearML's cache in ``tmp_path``. Yields the refused attempts; the test fails if there
    are any.
    """
    for name in _ONLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in _SET_BY_TRACKERS:  # set, then removed: monkeypatch removes them again after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.chdir(home)  # outside any Git repository (DVCLive would `dvc init` one)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml-cache"))
    refused: list[str] = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex
    lookup = socket.getaddrinfo

    def guarded_connect(self: socket.socket, address: Any) -> Any:
        if not _is_local(address):
            refused.append(f"connect {address!r}")
            raise ConnectionRefusedError(f"test without network: connect to {address!r}")
        return connect(self, address)

    def guarded_connect_ex(self: socket.socket, address: Any) -> Any:
        if not _is_local(address):
            refused.append(f"connect_ex {address!r}")
            return 111  # ECONNREFUSED
        return connect_ex(self, address)

    def guarded_lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_local(host):
            refused.append(f"getaddrinfo {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, f"test without network: {host!r}")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_lookup)
    yield refused
    assert refused == [], f"a tracker reached for the network: {refused}"
