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


def test_each_waiting_group_goes_out_after_one_of_the_longest_once_the_first_are_out() -> None:
    longest, waiting, after = worker_groups.LONGEST_FIRST, worker_groups.MOSTLY_WAITING, worker_groups.WAITING_AFTER
    groups = ["tests/spec/test_spec_hostile.py", waiting[1], longest[-1], longest[after + 1], waiting[0],
              longest[after], longest[after - 1], longest[0]]
    assert sorted(groups, key=worker_groups.hand_out_rank) == [
        longest[0], longest[after - 1], longest[after], waiting[0], longest[after + 1], waiting[1],
        longest[-1], "tests/spec/test_spec_hostile.py"]


def test_the_hand_out_order_names_every_listed_group_once_and_no_two_waiting_groups_follow_each_other() -> None:
    order = worker_groups.HAND_OUT_ORDER
    longest, waiting = worker_groups.LONGEST_FIRST, set(worker_groups.MOSTLY_WAITING)
    assert sorted(order) == sorted((*longest, *waiting))
    assert order[:worker_groups.WAITING_AFTER] == longest[:worker_groups.WAITING_AFTER]
    last_longest = max(order.index(g) for g in longest)
    pairs = zip(order[:last_longest + 1], order[1:last_longest + 2])
    assert not any(a in waiting and b in waiting for a, b in pairs), order
