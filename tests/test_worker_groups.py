"""How tests/worker_groups.py hands the suite to two pytest-xdist workers (docs/testing.md, "Two workers")."""

from __future__ import annotations

from types import SimpleNamespace

import worker_groups


def test_groups_keep_their_module_or_shared_start_up() -> None:
    assert worker_groups.xdist_group_of("tests/slurm/test_relax_jobs.py::test_x") == "slurm"
    assert worker_groups.xdist_group_of("tests/cli/test_wheel_install.py::test_y") == "slurm"
    assert worker_groups.xdist_group_of("tests/driver/test_omni_e2e.py::test_z") == "tests/driver/test_omni_e2e.py"


def test_two_workers_take_the_groups_in_the_longest_first_order_not_by_their_number_of_tests() -> None:
    # xdist's default (loadscopereorder) sorts groups by their number of tests, which handed the
    # long one-test groups out last.
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True),
                             getoption=lambda name, default=None: "loadgroup" if name == "dist" else default)
    worker_groups.keep_group_order(config)
    assert config.option.loadscopereorder is False


def test_the_longest_and_the_waiting_groups_are_named_once_and_exist() -> None:
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    named = (*worker_groups.LONGEST_FIRST, *worker_groups.MOSTLY_WAITING)
    assert len(set(named)) == len(named)
    for group in named:
        assert group in worker_groups.SHARED_GROUPS.values() or (repo / group).is_file(), group


def test_the_waiting_groups_go_out_between_the_first_of_the_longest_and_the_rest() -> None:
    longest, waiting, after = worker_groups.LONGEST_FIRST, worker_groups.MOSTLY_WAITING, worker_groups.WAITING_AFTER
    groups = ["tests/spec/test_spec_hostile.py", waiting[-1], longest[-1], longest[after], waiting[0],
              longest[after - 1], longest[0]]
    assert sorted(groups, key=worker_groups.hand_out_rank) == [
        longest[0], longest[after - 1], waiting[0], waiting[-1], longest[after], longest[-1],
        "tests/spec/test_spec_hostile.py"]
