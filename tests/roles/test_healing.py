"""RoleHealer: what a failure costs, stale heartbeat files, events (relax_hpc/roles/healing.py)."""

from __future__ import annotations

import pytest

from relax_hpc.ops.health import HealthConfig, HeartbeatWriter, heartbeat_path
from relax_hpc.roles.errors import GlobalRestartNeeded, RestartsExhausted
from relax_hpc.roles.healing import RoleHealer, is_core

CFG = HealthConfig(heartbeat_s=0.1, stale_s=0.5, max_in_place_restarts=3, max_global_restarts=1)


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


def test_a_role_that_dies_while_restarted_in_place_costs_a_global_restart_counted_as_its_failure(tmp_path):
    """The third kill of a role can land while its second replacement is still starting: the
    driver then restarts everything (global_restart), and the event still says why."""
    events = []
    healer = RoleHealer(CFG, tmp_path, on_event=events.append)
    healer.failed("reference", "died", restart=lambda: None)

    def dies_while_starting() -> None:
        raise RuntimeError("reference died while starting its heartbeat")

    with pytest.raises(RuntimeError):
        healer.failed("reference", "died", restart=dies_while_starting)
    event = healer.global_restart("reference", "died", "died while starting its heartbeat")
    assert [e.action for e in events] == ["in_place", "in_place", "global"]
    assert event.detail == "died while starting its heartbeat; failure 3 of this role in a row"
    assert healer.book.restarts_by_role == {"reference": 3}


def test_a_role_whose_first_replacement_dies_costs_a_global_restart_with_its_own_reason(tmp_path):
    healer = RoleHealer(CFG, tmp_path)
    event = healer.global_restart("reference", "died", "died while starting its heartbeat")
    assert (event.action, event.detail) == ("global", "died while starting its heartbeat")  # failure 1: no count


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
