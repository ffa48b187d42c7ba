"""Shared fixtures: one tiny Qwen3 model directory per test session (built locally, no downloads)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from relax_hpc.models.tiny import write_tiny_model
from relax_hpc.ops.ray_node_env import apply_ray_node_env

# Ray enables token auth when ~/.ray/auth_token exists; the tests start their own local clusters
# without one, also when pytest is run directly rather than through tools/run-tests.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The clusters the tests start themselves run with the settings of a job's own nodes: no idle
# worker prestarted per CPU (relax_hpc/ops/ray_node_env.py; docs/testing.md).
apply_ray_node_env(os.environ)

# Every listener of a job requires the job secret (docs/security.md, "Authentication"); roles
# started by a test, and the Ray workers they run in, find it through this variable.
if "RELAX_HPC_SECRET_FILE" not in os.environ:
    from relax_hpc.auth import JobSecret, write_job_secret

    os.environ["RELAX_HPC_SECRET_FILE"] = str(
        write_job_secret(Path(tempfile.mkdtemp(prefix="relax-test-secret-")), JobSecret.generate())
    )


# The tiny model's matrices are far too small to gain from intra-op threads, and on a shared,
# oversubscribed CPU a second OpenMP thread makes each matmul wait milliseconds for a core.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Written once per session; tests/driver overrides it with the seed of the embedded default.
    path = tmp_path_factory.getbasetemp() / "tiny-model-seed0"
    if not path.exists():
        write_tiny_model(path, seed=0)
    return path


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with the relax-hpc wheel installed: (its bin dir, the environment to run it in)."""
    from wheel_venv import build_wheel_venv

    return build_wheel_venv(tmp_path_factory.mktemp("wheel"))


# -- the per-test time budget (tests/time_budget.py) ----------------------------------------------

from side_env import build_wait_s  # noqa: E402
from time_budget import BUILD_WAIT_PROPERTY, TimeBudget, budget_s, enforced  # noqa: E402

_BUDGET = TimeBudget(budget_s())
_WAIT_MARK = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    item.stash[_WAIT_MARK] = build_wait_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Each phase's report says how long it waited for a background environment build."""
    outcome = yield
    now = build_wait_s()
    waited, item.stash[_WAIT_MARK] = now - item.stash.get(_WAIT_MARK, now), now
    if waited > 0:
        outcome.get_result().user_properties.append((BUILD_WAIT_PROPERTY, waited))


def pytest_sessionstart(session: pytest.Session) -> None:
    # Only where the decision is made (xdist's controller, or a plain run's one process).
    if not hasattr(session.config, "workerinput"):
        _BUDGET.note_start()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _BUDGET.add(report)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _BUDGET.lines():
        terminalreporter.write_line(line, red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Decided where every test's report arrives: the one process of a plain run, or xdist's controller.
    if hasattr(session.config, "workerinput"):
        return
    if enforced() and _BUDGET.over() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- groups for a run in two pytest-xdist workers (`--dist loadgroup`; docs/testing.md) ----------

from worker_groups import hand_out_rank, keep_group_order, xdist_group_of  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Refuse two workers where xdist cannot group: on pytest 9.2 its --dist loadgroup silently
    stops grouping (pytest-dev/pytest-xdist#1386), the tests of a module then run on both workers,
    each starting the module's servers (two SGLang fleets at once failed a test that way)."""
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "loadgroup":
        return
    keep_group_order(config)
    major, minor = (int(part) for part in pytest.__version__.split(".")[:2])
    if (major, minor) >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist's --dist loadgroup does not group tests; "
            "install what pyproject.toml's dev extra pins (tools/setup-env: pytest < 9.2), "
            "or run RELAX_TEST_WORKERS=0")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into "@group" node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.nodeid)))
    if hasattr(config, "workerinput"):  # an xdist worker (its collection orders the hand-out); a plain run keeps file order
        items.sort(key=lambda item: hand_out_rank(xdist_group_of(item.nodeid)))
