"""RoleHealer: what a failure costs, stale heartbeat files, events (relax_hpc/roles/healing.py)."""

from __future__ import annotations

import pytest

from relax_hpc.ops.health import HeartbeatWriter, heartbeat_path
from relax_hpc.roles.errors import GlobalRestartNeeded, RestartsExhausted, RoleDiedError, RoleTimeoutError
from relax_hpc.roles.healing import RoleHealer, is_core
from relax_hpc.spec.schema import HealthSpec

CFG = HealthSpec(heartbeat_s=0.1, stale_s=0.5, max_in_place_restarts=3, max_global_restarts=1)


def test_core_roles_are_the_trainer_rollout_and_actor_fwd():
    assert [is_core(r) for r in ("trainer_rank_0", "rollout", "actor_fwd", "reference", "advantages", "engine_3")] == \
        [True, True, True, False, False, False]


def test_in_place_restarts_then_a_global_restart_then_none_left(tmp_path):
    events, restarted = [], []
    healer = RoleHealer(CFG, tmp_path, on_event=events.append)
    for _ in range(2):
        healer.failed("reference", "died", restart=lambda: restarted.append("reference"))
    assert restarted == ["reference", "reference"]
    with pytest.raises(GlobalRestartNeeded, match="reference died: global restart"):
        healer.failed("reference", "died", restart=lambda: restarted.append("never"))
    assert restarted == ["reference", "reference"]
    with pytest.raises(RestartsExhausted, match="no restarts left"):
        healer.global_restart("trainer_rank_0", "died")
    assert [e.action for e in events] == ["in_place", "in_place", "global", "give_up"]


def test_a_replacement_that_dies_while_it_starts_is_the_roles_next_failure_decided_alike(tmp_path):
    """The rule for a role killed again while its replacement is still starting: the same as a
    kill after the replacement is serving. Kill 1 is restarted in place; the replacement dies
    inside `restart` (kill 2): in place again; the next replacement also dies while starting
    (kill 3, the max_in_place_restarts-th failure): a global restart, whose event names the count."""
    events, attempts = [], []

    def replacement_dies_while_starting() -> None:
        attempts.append(len(attempts))
        if len(attempts) <= 2:
            raise RoleDiedError(f"reference died while starting its heartbeat (attempt {len(attempts)})")

    healer = RoleHealer(CFG, tmp_path, on_event=events.append)
    with pytest.raises(GlobalRestartNeeded, match="failure 3 of this role in a row"):
        healer.failed("reference", "died", restart=replacement_dies_while_starting)
    assert [(e.role, e.problem, e.action) for e in events] == [
        ("reference", "died", "in_place"), ("reference", "died", "in_place"), ("reference", "died", "global")]
    assert events[1].detail == "while it was being restarted in place: reference died while starting its heartbeat (attempt 1)"
    assert attempts == [0, 1]  # the third failure started no third replacement
    assert healer.book.restarts_by_role == {"reference": 3}


def test_a_replacement_that_dies_while_starting_after_one_kill_is_served_by_the_next(tmp_path):
    events, attempts = [], []

    def first_replacement_dies() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RoleDiedError("reference died while loading its model")

    healer = RoleHealer(CFG, tmp_path, on_event=events.append)
    event = healer.failed("reference", "died", restart=first_replacement_dies)
    assert [e.action for e in events] == ["in_place", "in_place"] and event is events[-1]
    assert len(attempts) == 2 and healer.role_states()["reference"]["restarts"] == 2


def test_a_replacement_that_does_not_answer_while_starting_counts_as_stopped_answering(tmp_path):
    events = []

    def hangs() -> None:
        raise RoleTimeoutError("reference did not answer 'restarting its loop' within 60 s")

    healer = RoleHealer(CFG, tmp_path, on_event=events.append)
    with pytest.raises(GlobalRestartNeeded):
        healer.failed("reference", "died", restart=hangs)
    assert [(e.problem, e.action) for e in events] == [
        ("died", "in_place"), ("stopped answering", "in_place"), ("stopped answering", "global")]


def test_a_decision_raised_inside_a_restart_is_passed_on_not_counted_again(tmp_path):
    events = []
    healer = RoleHealer(CFG, tmp_path, on_event=events.append)

    def engine_failure_decided_inside() -> None:
        healer.failed("rollout", "died")  # a core role: GlobalRestartNeeded

    with pytest.raises(GlobalRestartNeeded, match="rollout died"):
        healer.failed("reference", "died", restart=engine_failure_decided_inside)
    assert [(e.role, e.action) for e in events] == [("reference", "in_place"), ("rollout", "global")]


def test_a_failure_met_outside_the_health_checks_costs_a_global_restart_with_its_own_reason(tmp_path):
    healer = RoleHealer(CFG, tmp_path)
    event = healer.global_restart("reference", "died", "died while the driver called it")
    assert (event.action, event.detail) == ("global", "died while the driver called it")  # failure 1: no count


def test_a_core_role_is_never_restarted_in_place(tmp_path):
    healer = RoleHealer(CFG, tmp_path)
    with pytest.raises(GlobalRestartNeeded):
        healer.failed("rollout", "stopped answering", restart=lambda: pytest.fail("restarted in place"))


def test_stale_roles_come_from_the_heartbeat_files(tmp_path):
    healer = RoleHealer(CFG, tmp_path)
    beating = HeartbeatWriter(heartbeat_path(tmp_path, "rollout"), "rollout", 3600.0)
    beating.beat()
    healer.watch("rollout")
    healer.watch("reference")  # never beats
    healer.stale.stale_s = 0.0  # anything silent since the last look is stale
    beating.beat()
    assert healer.stale_roles() == ["reference"]
    healer.forget("reference")
    assert healer.stale_roles() == ["rollout"]  # no beat since the last look


def test_a_dead_engine_whose_replacement_joined_shows_replaced_not_restarting(tmp_path):
    """A rollout engine is not restarted: a new engine (another id) joins in its place. status.json
    showed the dead one "restarting" for the rest of the run; now "replaced", its restart counted."""
    healer = RoleHealer(CFG, tmp_path)
    healer.watch("engine_1")
    healer.failed("engine_1", "died", "its prompts went to the other engines", restart=lambda: None)
    assert healer.role_states()["engine_1"] == {"state": "restarting", "restarts": 1}
    healer.replaced("engine_1")
    assert healer.role_states()["engine_1"] == {"state": "replaced", "restarts": 1}
    assert "engine_1" not in healer.stale.roles()  # its silence is not a failure any more
