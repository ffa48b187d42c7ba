"""Ray actors for tests/roles/test_role_deadlines.py, in a module of their own so that an actor
process imports only this (os, time, ray), not the test module's torch and relax_hpc imports."""

from __future__ import annotations

import os
import time

import ray


@ray.remote
class FakeRole:
    """A role whose calls sleep, fail, or wait for a peer the way a collective does."""

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self) -> None:
        raise ValueError("bad rows")

    def fail_to_resume(self) -> None:
        from relax_hpc.ckpt.errors import NoUsableCheckpointError  # standard library only

        raise NoUsableCheckpointError("no checkpoint of /j/checkpoints loads (step_3: resume.json is missing); "
                                      "fix it, or relax-hpc run --start-over")

    def fail_when_gone(self, peer_pid: int) -> None:
        """Like a gloo collective whose peer died: raise once that process is gone."""
        while _alive(peer_pid):
            time.sleep(0.01)
        raise ConnectionResetError("Connection closed by peer")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has died
    except OSError:
        return False


@ray.remote
class BrokenRole:
    def __init__(self) -> None:
        raise OSError("no such model: /models/missing")

    def pid(self) -> int:
        return os.getpid()
