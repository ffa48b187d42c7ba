"""Helpers for the tests in tests/slurm: drive tools/dev-slurm and the Slurm client commands.

Kept out of conftest.py so test modules can import them by name (``import devslurm``).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.launch.slurm_client import QUERY_ATTEMPTS, transient_failure

REPO_ROOT = Path(__file__).resolve().parents[2]
DEV_SLURM = REPO_ROOT / "tools" / "dev-slurm"
DEFAULT_STATE_DIR = Path("/tmp/relax-dev-slurm")
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
     "BOOT_FAIL", "DEADLINE"}
)


def state_dir_from_env() -> Path:
    """The state directory tools/dev-slurm uses in this environment."""
    return Path(os.environ.get("RELAX_DEV_SLURM_DIR") or DEFAULT_STATE_DIR)


def run_dev_slurm(
    args: Sequence[str], state_dir: Path | None = None, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Run tools/dev-slurm with ``args`` (optionally against another state dir)."""
    env = dict(os.environ)
    if state_dir is not None:
        env["RELAX_DEV_SLURM_DIR"] = str(state_dir)
    return subprocess.run(
        [str(DEV_SLURM), *args], capture_output=True, text=True, timeout=timeout, env=env,
        check=False,
    )


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (PID 1 may reap exited daemons late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state field follows the ")" that closes the command name.
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_pids(state_dir: Path) -> dict[str, int]:
    """Daemon name -> PID, from the PID files tools/dev-slurm writes."""
    return {
        path.stem: int(path.read_text().strip()) for path in sorted((state_dir / "pids").glob("*.pid"))
    }


def read_shape(state_dir: Path) -> dict[str, int]:
    """The shape file written by ``up``: nodes, cpus, accounting, port_base."""
    text = (state_dir / "shape").read_text().split()
    return {key: int(value) for key, value in (item.split("=", 1) for item in text)}


@dataclass(frozen=True)
class DevSlurm:
    """A running dev cluster and helpers to drive its Slurm client commands."""

    state_dir: Path
    nodes: int
    cpus: int
    port_base: int

    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    def env(self) -> dict[str, str]:
        """This process's environment with SLURM_CONF pointing at the dev cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def slurm(self, *args: str, timeout: float = 60.0) -> str:
        """Run a Slurm client command (sbatch, scontrol, ...) and return its stdout. A query
        (squeue, sacct, sinfo, scontrol show) is asked again after a transient failure, as the
        product's client does (relax_hpc/launch/slurm_client.py)."""
        query = args[0] in ("squeue", "sacct", "sinfo") or args[:2] == ("scontrol", "show")
        for attempt in range(1, QUERY_ATTEMPTS + 1):
            done = subprocess.run(
                list(args), capture_output=True, text=True, timeout=timeout, env=self.env(), check=False
            )
            if done.returncode == 0:
                return done.stdout
            if not (query and attempt < QUERY_ATTEMPTS and transient_failure(done.returncode, done.stderr)):
                break
            time.sleep(attempt)
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")

    def job_states(self, job_id: str) -> list[str]:
        """JobState of every component of ``job_id`` (one entry for a plain job)."""
        text = self.slurm("scontrol", "show", "job", "-o", job_id)
        return re.findall(r"\bJobState=(\S+)", text)

    def wait_job_done(self, job_id: str, timeout: float = 60.0) -> list[str]:
        """Poll until every component of ``job_id`` is in a terminal state; return the states."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.job_states(job_id)
            if states and all(state in TERMINAL_STATES for state in states):
                return states
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not finished after {timeout}s: {states}")
            time.sleep(0.3)
