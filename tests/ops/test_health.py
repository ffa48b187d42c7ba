"""Heartbeat files, the stale watch and the restart policy (relax_hpc/ops/health.py)."""

from __future__ import annotations

import json
import os
import stat

from relax_hpc.ops.health import (
    HeartbeatWriter,
    RestartBook,
    StaleWatch,
    heartbeat_path,
    read_heartbeats,
)
from relax_hpc.spec.schema import HealthSpec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_file_is_written_at_once_owner_only_and_counts_beats(tmp_path):
    writer = HeartbeatWriter(heartbeat_path(tmp_path, "reference"), "reference", 3600.0, doing=lambda: "step 4")
    writer.start()
    writer.beat()
    writer.stop()
    path = tmp_path / "health" / "reference.json"
    record = json.loads(path.read_text())
    assert record["role"] == "reference" and record["pid"] == os.getpid()
    assert record["beat"] == 2 and record["doing"] == "step 4"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["reference.json"]  # no temp file left


def test_a_beat_names_the_slurm_node_which_tells_nodes_on_one_host_apart(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    HeartbeatWriter(heartbeat_path(tmp_path, "driver"), "driver", 3600.0).beat()
    assert read_heartbeats(tmp_path)["driver"]["node"] is None  # not under Slurm
    monkeypatch.setenv("SLURMD_NODENAME", "n3")  # what slurmd sets for every process of a step
    HeartbeatWriter(heartbeat_path(tmp_path, "reference"), "reference", 3600.0).beat()
    assert read_heartbeats(tmp_path)["reference"]["node"] == "n3"


def test_a_failing_doing_never_stops_the_beat(tmp_path):
    def broken() -> str:
        raise ValueError("boom")

    writer = HeartbeatWriter(heartbeat_path(tmp_path, "rollout"), "rollout", 3600.0, doing=broken)
    writer.start()
    writer.stop()
    assert read_heartbeats(tmp_path)["rollout"]["doing"] == "? (ValueError)"


def test_read_heartbeats_skips_files_that_are_not_heartbeats(tmp_path):
    HeartbeatWriter(heartbeat_path(tmp_path, "driver"), "driver", 3600.0).beat()
    (tmp_path / "health" / "torn.json").write_text("{not json")
    (tmp_path / "health" / "list.json").write_text("[1, 2]")
    assert list(read_heartbeats(tmp_path)) == ["driver"]
    assert read_heartbeats(tmp_path / "missing") == {}


def test_stale_watch_goes_by_the_readers_clock_not_the_beat_time():
    clock = Clock()
    watch = StaleWatch(stale_s=10.0, clock=clock)
    watch.watch("reference", beat=1)
    watch.watch("rollout", beat=None)       # no beat yet: the clock runs from now
    clock.now += 6
    assert watch.check({"reference": 2, "rollout": None}) == []    # reference beat: its clock restarts at 106
    clock.now += 5                                                    # 111: rollout silent 11 s, reference 5 s
    assert watch.check({"reference": 2}) == ["rollout"]
    clock.now += 6                                                    # 117: reference silent 11 s too
    assert watch.check({"reference": 2}) == ["rollout", "reference"]  # the longest silence first
    watch.forget("rollout")
    assert watch.check({"reference": 3}) == []


def test_restart_book_in_place_until_the_third_failure_of_a_role():
    book = RestartBook(HealthSpec(max_in_place_restarts=3, max_global_restarts=1))
    assert book.decide("reference", "died", core=False).action == "in_place"
    assert book.decide("advantages", "died", core=False).action == "in_place"  # counted per role
    assert book.decide("reference", "died", core=False).action == "in_place"
    third = book.decide("reference", "died", core=False)
    assert third.action == "global" and "failure 3 of this role" in third.detail
    assert book.decide("reference", "died", core=False).action == "in_place"  # counts start afresh
    assert book.decide("trainer_rank_0", "died", core=True).action == "give_up"  # the one global is spent
    assert (book.in_place, book.global_restarts) == (4, 1)
    assert book.metrics() == {"health/in_place_restarts": 4.0, "health/global_restarts": 1.0}
    summary = book.summary()
    assert [e["action"] for e in summary["events"]] == ["in_place", "in_place", "in_place", "global", "in_place",
                                                        "give_up"]


def test_a_failure_that_cannot_be_handled_in_place_is_global_and_still_counted():
    book = RestartBook(HealthSpec(max_in_place_restarts=3, max_global_restarts=3))
    assert book.decide("reference", "died", core=False).action == "in_place"
    first = book.decide("reference", "died", core=False, detail="while restarting", in_place_possible=False)
    assert (first.action, first.detail) == ("global", "while restarting")  # failure 2 of 3: the count is not why
    assert book.failures == {}  # a global restart starts every count afresh
    for _ in range(2):
        book.decide("reference", "died", core=False)
    third = book.decide("reference", "died", core=False, detail="while restarting", in_place_possible=False)
    assert third.detail == "while restarting; failure 3 of this role in a row"


def test_a_core_role_costs_a_global_restart_at_once():
    book = RestartBook(HealthSpec(max_in_place_restarts=3, max_global_restarts=3))
    event = book.decide("trainer_rank_1", "died", core=True, detail="pid 7")
    assert event.action == "global"
    assert event.line() == "trainer_rank_1 died: global restart from the newest checkpoint (pid 7)"
