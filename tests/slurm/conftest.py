"""Fixtures for tests that run against a real Slurm: the local cluster of tools/dev-slurm.

The session fixture ``dev_slurm`` uses a dev cluster that is already up (in
``$RELAX_DEV_SLURM_DIR``, default /tmp/relax-dev-slurm), or starts one with
``tools/dev-slurm up`` when ``RELAX_TEST_SLURM=1`` (and stops it again at the end of the
session). Otherwise every test that asks for it is skipped. Run with::

    RELAX_TEST_SLURM=1 .venv/bin/pytest tests/slurm -q
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from devslurm import DevSlurm, read_shape, run_dev_slurm, state_dir_from_env

SKIP_REASON = "local Slurm not running; set RELAX_TEST_SLURM=1 or run tools/dev-slurm up"


@pytest.fixture(scope="session")
def dev_slurm() -> Iterator[DevSlurm]:
    """The local dev cluster; skips unless it is up or RELAX_TEST_SLURM=1 lets us start it."""
    state_dir = state_dir_from_env()
    started_here = False
    if run_dev_slurm(["status"]).returncode != 0:
        if os.environ.get("RELAX_TEST_SLURM") != "1":
            pytest.skip(SKIP_REASON)
        up = run_dev_slurm(["up"], timeout=600)
        if up.returncode != 0:
            pytest.fail(f"tools/dev-slurm up failed (exit {up.returncode}):\n{up.stderr}")
        started_here = True
    shape = read_shape(state_dir)
    try:
        yield DevSlurm(state_dir, shape["nodes"], shape["cpus"], shape["port_base"])
    finally:
        if started_here:
            run_dev_slurm(["down"])
