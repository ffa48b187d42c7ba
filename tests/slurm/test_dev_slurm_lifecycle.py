"""tools/dev-slurm itself: `up` is idempotent, refuses a second shape, `down` stops only its PIDs.

Needs tools/dev-slurm (see conftest.py); run with RELAX_TEST_SLURM=1.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from devslurm import DevSlurm, pid_alive, read_pids, read_shape, run_dev_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(660)]


def shape_args(cluster: DevSlurm) -> list[str]:
    args = ["--nodes", str(cluster.nodes), "--cpus", str(cluster.cpus),
            "--port-base", str(cluster.port_base)]
    if read_shape(cluster.state_dir)["accounting"]:
        args.append("--accounting")
    return args


def test_up_twice_is_idempotent(dev_slurm: DevSlurm) -> None:
    before = read_pids(dev_slurm.state_dir)
    done = run_dev_slurm(["up", *shape_args(dev_slurm)])
    assert done.returncode == 0, done.stderr
    assert "already up" in done.stderr
    assert done.stdout == f"export SLURM_CONF={dev_slurm.conf}\n"
    assert read_pids(dev_slurm.state_dir) == before


def test_up_with_another_shape_is_refused(dev_slurm: DevSlurm) -> None:
    before = read_pids(dev_slurm.state_dir)
    args = shape_args(dev_slurm)
    args[1] = str(dev_slurm.nodes + 1)
    done = run_dev_slurm(["up", *args])
    assert done.returncode == 1
    assert "tools/dev-slurm down" in done.stderr and f"nodes={dev_slurm.nodes + 1}" in done.stderr
    assert read_pids(dev_slurm.state_dir) == before


@pytest.fixture
def scratch_state_dir() -> Iterator[Path]:
    # Short path under /tmp: the munge socket path must fit a UNIX socket address.
    path = Path(tempfile.mkdtemp(prefix="rds-", dir="/tmp"))
    try:
        yield path
    finally:
        run_dev_slurm(["down"], state_dir=path)
        shutil.rmtree(path, ignore_errors=True)


def test_second_cluster_with_accounting_up_status_down(
    dev_slurm: DevSlurm, scratch_state_dir: Path
) -> None:
    # A second, one-node cluster beside the first one (own state dir and ports), with
    # slurmdbd + MariaDB so that sacct works. Installs slurmdbd/mariadb-server if missing.
    port_base = dev_slurm.port_base + 1000
    started = time.monotonic()
    up = run_dev_slurm(
        ["up", "--nodes", "1", "--cpus", "1", "--accounting", "--port-base", str(port_base)],
        state_dir=scratch_state_dir, timeout=600,
    )
    up_seconds = time.monotonic() - started
    assert up.returncode == 0, up.stderr
    conf = scratch_state_dir / "slurm.conf"
    assert up.stdout == f"export SLURM_CONF={conf}\n"
    pids = read_pids(scratch_state_dir)
    assert set(pids) == {"munged", "mariadb", "slurmdbd", "slurmctld", "slurmd-n1"}
    assert all(pid_alive(pid) for pid in pids.values())
    status = run_dev_slurm(["status"], state_dir=scratch_state_dir)
    assert status.returncode == 0 and "idle" in status.stdout, status.stdout

    second = DevSlurm(scratch_state_dir, nodes=1, cpus=1, port_base=port_base)
    job_id = second.slurm("sbatch", "--parsable", "--wait", "-o", "/dev/null", "--wrap", "srun true").strip()
    sacct = ""
    deadline = time.monotonic() + 20
    while "COMPLETED" not in sacct and time.monotonic() < deadline:
        sacct = second.slurm("sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id)
        time.sleep(0.3)
    assert sacct.strip() == f"{job_id}|COMPLETED", f"sacct said {sacct!r} (up took {up_seconds:.1f}s)"

    down = run_dev_slurm(["down"], state_dir=scratch_state_dir)
    assert down.returncode == 0, down.stderr
    assert [name for name, pid in pids.items() if pid_alive(pid)] == []
    assert run_dev_slurm(["status"], state_dir=scratch_state_dir).returncode == 1
    # The first cluster is untouched.
    assert all(pid_alive(pid) for pid in read_pids(dev_slurm.state_dir).values())
    assert run_dev_slurm(["down"], state_dir=scratch_state_dir).returncode == 0
    purge = run_dev_slurm(["down", "--purge"], state_dir=scratch_state_dir)
    assert purge.returncode == 0, purge.stderr
    assert not scratch_state_dir.exists()


def test_purge_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("not ours")
    done = run_dev_slurm(["down", "--purge"], state_dir=tmp_path)
    assert done.returncode == 1 and "refusing to purge" in done.stderr
    assert (tmp_path / "keep.txt").exists()
