"""For the tracker tests: a sandbox that proves the W&B, ClearML and MLflow sinks stay offline and out
of the home directory, and skip marks naming the package a test needs."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

needs_wandb = pytest.mark.skipif(find_spec("wandb") is None,
                                 reason="wandb is not installed (pip install 'relax-hpc[trackers]')")
needs_clearml = pytest.mark.skipif(find_spec("clearml") is None,
                                   reason="clearml is not installed (pip install 'relax-hpc[trackers]')")
needs_mlflow = pytest.mark.skipif(find_spec("mlflow") is None,
                                  reason="mlflow is not installed (pip install 'relax-hpc[trackers]')")

# What the sinks set in os.environ; put back after each test.
TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR",
               "CLEARML_CACHE_DIR", "CLEARML_OFFLINE_MODE", "CLEARML_CONFIG_FILE", "MLFLOW_ALLOW_FILE_STORE",
               "MLFLOW_DISABLE_TELEMETRY")


def _is_local(address: Any) -> bool:
    if not isinstance(address, tuple):  # a Unix socket path: W&B's own service
        return True
    host = address[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def offline_sandbox(monkeypatch: pytest.MonkeyPatch, home: Path) -> Iterator[list[Any]]:
    """HOME moved to `home` (which must stay empty) and every connection this process opens to
    anything but loopback or a Unix socket refused and recorded (the list must stay empty)."""
    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    if find_spec("clearml") is not None:
        from clearml.config.cache import SessionCache

        monkeypatch.setattr(SessionCache, "SESSION_CACHE_FOLDER", SessionCache.SESSION_CACHE_FOLDER)
    attempts: list[Any] = []
    connect = socket.socket.connect

    def local_only(sock: socket.socket, address: Any) -> None:
        if not _is_local(address):
            attempts.append(address)
            raise OSError(f"this test allows no network: {address!r}")
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    yield attempts
    assert attempts == [], f"connections attempted: {attempts}"
    assert sorted(os.listdir(home)) == [], "written into the home directory"
