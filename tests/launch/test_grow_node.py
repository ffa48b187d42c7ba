"""A grow job's node without Slurm: the pure decision for each thing it can see, the watcher's
register / re-register / stop / leave paths over an in-memory REST API, and the engine servers
as real child processes (their URL line read, SIGUSR1 ignored, stopped by PID)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic_fakes import FakeElastic, InMemoryRest

from relax_hpc.launch.federation import ElasticApi
from relax_hpc.launch.grow_node import (
    EXIT_FAILED,
    Action,
    EngineServers,
    GrowNode,
    Observation,
    WatchLimits,
    decide,
    engine_command,
    engine_device,
    engines_on_node,
    listed_states,
)
from relax_hpc.launch.slurm_client import FakeSlurmClient, JobComponent

MINE = ("http://10.0.0.7:4000", "http://10.0.0.7:4001")
LIMITS = WatchLimits(ended_confirm_s=30.0, orphan_after_s=600.0)


def look(**changes: object) -> Observation:
    """A node serving MINE in a running main job that lists them active; ``changes`` on top."""
    base = {"mine": MINE, "listed": {"in-job": "active", MINE[0]: "active", MINE[1]: "active"},
            "main_state": "RUNNING"}
    return Observation(**{**base, **changes})  # type: ignore[arg-type]


# --- decide ---------------------------------------------------------------------------------------


def test_a_listed_engines_serve_on() -> None:
    assert decide(look(), LIMITS).kind == "wait"
    joining = {"in-job": "active", MINE[0]: "joining", MINE[1]: "draining"}
    assert decide(look(listed=joining), LIMITS).kind == "wait"


def test_b_engines_missing_from_the_list_register_again() -> None:
    # A requeued main job: a new driver whose list has only its own engines.
    assert decide(look(listed={"in-job": "active"}), LIMITS) == Action("register", MINE, "not in the main job's engine list")
    assert decide(look(listed={"in-job": "active", MINE[0]: "active"}), LIMITS).urls == (MINE[1],)


def test_c_removed_engines_stop_and_the_node_exits_when_none_is_left() -> None:
    action = decide(look(listed={MINE[0]: "gone", MINE[1]: "active"}), LIMITS)
    assert (action.kind, action.urls) == ("stop", (MINE[0],))
    assert decide(look(listed={MINE[0]: "failed", MINE[1]: "gone"}), LIMITS).urls == MINE
    assert decide(look(mine=()), LIMITS) == Action("exit", (), "every engine of this node was removed from the job", 0)


def test_d_the_node_exits_once_the_main_job_has_ended() -> None:
    assert decide(look(main_state="COMPLETED", main_ended_for_s=10.0), LIMITS).kind == "wait"  # not confirmed yet
    assert decide(look(main_state="COMPLETED", main_ended_for_s=30.0), LIMITS).kind == "exit"
    assert decide(look(main_state="", main_ended_for_s=31.0, listed=None), LIMITS).reason == \
        "the main job ended (no longer in the queue)"
    assert decide(look(main_state="CANCELLED by 1000", main_ended_for_s=60.0), LIMITS).code == 0


def test_d_a_silent_api_ends_the_node_only_while_the_main_job_does_not_run() -> None:
    assert decide(look(listed=None, unanswered_for_s=10_000.0), LIMITS).kind == "wait"  # RUNNING: a restarting driver
    assert decide(look(listed=None, main_state=None, unanswered_for_s=599.0), LIMITS).kind == "wait"  # squeue fails
    assert "of unknown state" in decide(look(listed=None, main_state=None, unanswered_for_s=600.0), LIMITS).reason
    assert decide(look(listed=None, main_state="PENDING", unanswered_for_s=599.0), LIMITS).kind == "wait"  # requeued
    action = decide(look(listed=None, main_state="PENDING", unanswered_for_s=600.0), LIMITS)
    assert action.kind == "exit" and action.code == 0 and "job is PENDING" in action.reason


def test_a_signal_leaves_before_anything_else() -> None:
    assert decide(look(signal="USR1", main_state="COMPLETED", main_ended_for_s=99.0), LIMITS) == \
        Action("leave", MINE, "got SIGUSR1")


def test_dead_servers_end_the_node_with_a_failure() -> None:
    assert decide(look(mine=(), died=2), LIMITS).code == EXIT_FAILED


def test_the_newest_entry_of_an_address_counts() -> None:
    listed = listed_states([{"address": MINE[0] + "/", "state": "gone"}, {"address": MINE[0], "state": "active"}])
    assert listed == {MINE[0]: "active"}


def test_engines_spread_over_nodes_and_gpus() -> None:
    assert [engines_on_node(5, 2, n) for n in range(2)] == [3, 2]
    assert [engines_on_node(4, 4, n) for n in range(4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="not one of the grow job's 2 nodes"):
        engines_on_node(4, 2, 2)
    assert [engine_device(k, 2) for k in range(3)] == ["cuda:0", "cuda:1", "cuda:0"] and engine_device(0, 0) == "cpu"


def test_engine_command_serves_the_jobs_weights_on_a_free_port() -> None:
    cmd = engine_command("/py", "/models/m", "10.0.0.7", Path("/j/federation/weights"), Path("/j/t.token"),
                         "bfloat16", "cuda:1")
    assert cmd[:5] == ["/py", "-m", "relax_hpc.cli.main", "serve-engine", "/models/m"]
    text = " ".join(cmd)
    assert "--host 10.0.0.7 --port 0 --weights-root /j/federation/weights" in text
    assert "--dtype bfloat16 --device cuda:1" in text and "--token-file /j/t.token" in text


# --- the watcher --------------------------------------------------------------------------------


class FakeServers:
    """EngineServers' interface over a list of URLs: what was stopped, and deaths on demand."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = list(urls)
        self.stopped: list[str] = []
        self.dead: list[str] = []
        self._reported: set[str] = set()

    def running(self) -> tuple[str, ...]:
        return tuple(u for u in self.urls if u not in self.stopped and u not in self.dead)

    def newly_dead(self) -> list[tuple[str, int, Path]]:
        new = [u for u in self.dead if u not in self._reported]
        self._reported.update(new)
        return [(u, -9, Path("/j/logs/e.log")) for u in new]

    def stop(self, urls: list[str] | tuple[str, ...] | None = None) -> None:
        self.stopped += [u for u in (self.urls if urls is None else urls) if u not in self.stopped]


class Clock:
    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def node_with(control: FakeElastic, events: list[Callable[[], None] | None], *, servers: FakeServers | None = None,
              slurm: FakeSlurmClient | None = None, clock_step_s: float = 1.0,
              rest: InMemoryRest | None = None) -> GrowNode:
    """A GrowNode whose every look at the REST API first runs the next of ``events``."""
    rest = rest or InMemoryRest(control)
    api = ElasticApi(rest, "http://main:8000", "1000")
    pending = iter(events)

    def api_for() -> ElasticApi:
        event = next(pending, "end")
        assert event != "end", "the node should have stopped by now"
        if event is not None:
            event()
        return api

    if slurm is None:
        slurm = FakeSlurmClient(jobs={"1000": [JobComponent("1000", 0, "RUNNING", "n0")]})
    return GrowNode(servers or FakeServers(MINE), api_for, slurm, "1000", "2000", drain_timeout_s=30.0,  # type: ignore[arg-type]
                    limits=LIMITS, poll_s=0.0, slurm_poll_s=0.0, clock=Clock(clock_step_s))


def gone(control: FakeElastic) -> Callable[[], None]:
    def mark() -> None:
        for engine in control.engines:
            if engine["address"] in MINE:
                engine["state"] = "gone"
    return mark


def test_registers_serves_and_exits_when_shrink_removed_its_engines() -> None:
    control = FakeElastic()
    servers = FakeServers(MINE)
    # looks: absent -> register (start, then the operation's look uses the same api) ; serving ; gone
    node = node_with(control, [None, None, None, gone(control), None], servers=servers)
    assert node.run() == 0
    assert control.posted("scale_out") == [{"engine_urls": list(MINE), "job": "2000"}]
    assert servers.stopped == list(MINE)


def test_a_requeued_main_job_gets_the_engines_registered_again() -> None:
    control = FakeElastic()
    node = node_with(control, [None, None, None, control.restart, None, None, gone(control), None])
    assert node.run() == 0
    assert control.posted("scale_out") == [{"engine_urls": list(MINE), "job": "2000"}] * 2


def test_a_main_job_requeued_while_it_registers_the_engines_gets_them_registered_again() -> None:
    # A clean-clone run's failure (2026-12-02): the requeue killed the rollout role between the POST and the
    # operation's look, the REST API answered 503, and the node took that for a refusal and stopped.
    control = FakeElastic()
    control.outcome, control.unanswered_lookups = "running", 1
    servers = FakeServers(MINE)

    def requeued() -> None:
        control.restart()
        control.outcome = "done"

    # looks: absent -> register (POST, then 503) ; requeued, absent -> register ; serving ; gone -> leave
    node = node_with(control, [None, None, requeued, None, None, gone(control), None], servers=servers)
    assert node.run() == 0
    assert control.posted("scale_out") == [{"engine_urls": list(MINE), "job": "2000"}] * 2
    assert servers.stopped == list(MINE)  # stopped at the end, not at the 503


def test_a_rolled_back_registration_stops_the_servers_and_fails() -> None:
    control = FakeElastic()
    control.outcome = "rolled_back"
    servers = FakeServers(MINE)
    assert node_with(control, [None, None], servers=servers).run() == EXIT_FAILED
    assert servers.stopped == list(MINE)


@pytest.mark.parametrize(("signum", "timeout_s"), [(signal.SIGUSR1, 30.0), (signal.SIGTERM, 5.0)])
def test_a_signal_drains_the_engines_then_stops_them(signum: int, timeout_s: float) -> None:
    control = FakeElastic()
    control.elastic("scale_out", {"engine_urls": list(MINE), "job": "2000"})
    servers = FakeServers(MINE)
    node = node_with(control, [None, None], servers=servers)
    node.on_signal(signum)
    assert node.run() == 0
    assert control.posted("scale_in") == [{"engine_urls": list(MINE), "timeout_s": timeout_s}]
    assert [e["state"] for e in control.engines] == ["active", "gone", "gone"]
    assert servers.stopped == list(MINE)


def test_a_signal_with_the_api_down_still_stops_the_servers() -> None:
    control = FakeElastic()
    rest = InMemoryRest(control)
    rest.down = True
    servers = FakeServers(MINE)
    node = node_with(control, [None, None], servers=servers, rest=rest)
    node.on_signal(signal.SIGTERM)
    assert node.run() == 0 and servers.stopped == list(MINE) and control.calls == []


def test_the_node_exits_after_the_main_job_ended() -> None:
    control = FakeElastic()
    control.elastic("scale_out", {"engine_urls": list(MINE), "job": "2000"})
    slurm = FakeSlurmClient(jobs={"1000": [JobComponent("1000", 0, "COMPLETED", "n0")]})
    servers = FakeServers(MINE)
    # 10 s per look: ended at the first, confirmed (30 s) at the fourth.
    assert node_with(control, [None] * 4, servers=servers, slurm=slurm, clock_step_s=10.0).run() == 0
    assert servers.stopped == list(MINE) and control.posted("scale_in") == []


def test_dead_servers_are_logged_and_the_last_death_fails_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    control = FakeElastic()
    control.elastic("scale_out", {"engine_urls": list(MINE), "job": "2000"})
    servers = FakeServers(MINE)
    die_one, die_other = (lambda: servers.dead.append(MINE[0])), (lambda: servers.dead.append(MINE[1]))
    assert node_with(control, [die_one, die_other, None], servers=servers).run() == EXIT_FAILED
    assert capsys.readouterr().err.count("exited (-9) without being asked") == 2


# --- the engine servers as processes ----------------------------------------------------------


def _ignores_usr1(pid: int) -> bool:
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))


def test_engine_servers_start_print_their_url_ignore_usr1_and_stop(tmp_path: Path) -> None:
    serve = "import time; print('http://127.0.0.1:4000/', flush=True); time.sleep(300)"
    servers = EngineServers([[sys.executable, "-c", serve]], [tmp_path / "e0.log"], env={})
    try:
        assert servers.start(60.0, lambda: False) is None
        assert servers.urls == ["http://127.0.0.1:4000"] and servers.running() == ("http://127.0.0.1:4000",)
        assert _ignores_usr1(servers.procs[0].pid)  # the USR1 srun passes to the step leaves it serving
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_IGN  # the node itself still takes it
    finally:
        servers.stop()
    assert servers.procs[0].poll() is not None and servers.newly_dead() == []  # asked to stop: not a death


def test_an_engine_that_exits_before_its_url_is_reported_with_its_log(tmp_path: Path) -> None:
    fail = "import sys; print('no model at /models/x', file=sys.stderr); sys.exit(3)"
    servers = EngineServers([[sys.executable, "-c", fail]], [tmp_path / "e0.log"], env={})
    problem = servers.start(60.0, lambda: False)
    assert problem is not None and "exited (3) before printing its URL" in problem and str(tmp_path / "e0.log") in problem
    assert "no model at /models/x" in (tmp_path / "e0.log").read_text()
