"""The trainer never waits for the loop: the next step is queued behind the current one and its
broadcast. Call order, checkpoints, stop requests, errors, and the staleness bound.

The first tests drive `run_loop` with recording role doubles (fast, exact order of calls); the
last ones run real workers: in process with a broadcast that fails, and on Ray with
max_staleness 1 and the Advantages role as an actor, where every archived sample must respect
the bound.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import tiny_spec_text
from relax_hpc.ckpt import ResumeState
from relax_hpc.driver.loop import LoopTables, StopFlag, run_loop
from relax_hpc.ops.metrics import InMemorySink
from relax_hpc.roles.handles import RoleDiedError
from relax_hpc.weights.channel import WeightChannelError
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, TrainSpec

CHANNEL_ERROR = "weight sync to version 2 failed: sender: WeightChannelTimeout: receiver rank(s) [1] did not start"


class RecordedPending:
    def __init__(self, events: list[str], version: int, error: str | None) -> None:
        self.events, self.version, self.error = events, version, error

    def wait(self) -> None:
        self.events.append(f"wait {self.version}")
        if self.error:
            raise WeightChannelError(self.error)


class RecordedWeights:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def sync(self, version: int) -> None:
        self.events.append(f"sync {version}")


class RecordedTicket:
    """A training step the trainer runs in submission order; `result` is when the loop asks.
    The trainer starts the step's broadcast itself; `published` posts the receivers."""

    def __init__(self, roles: "RecordedRoles", step: int, version: int) -> None:
        self.roles, self.step, self.version = roles, step, version

    def result(self) -> dict[str, float]:
        self.roles.events.append(f"train {self.step}")
        if self.step == self.roles.train_dies_at:
            raise RoleDiedError(f"trainer rank 1 died while training step {self.step} (pid 4242)")
        if self.step == self.roles.train_fails_at:
            raise TimeoutError(f"get from 'train_{self.step}' timed out; is the producer of those fields running?")
        return {"rows": 4.0, "reward_sum": 1.0, "loss": 0.5, "train_s": 0.01, "sync_s": 0.001}

    def published(self) -> RecordedPending:
        self.roles.events.append(f"post {self.version}")
        error = CHANNEL_ERROR if self.version == self.roles.failing_version else None
        return RecordedPending(self.roles.events, self.version, error)


class RecordedRoles:
    """Every call the loop makes, in order; training step `train_fails_at` raises like a starved
    queue, `train_dies_at` like a trainer rank that died; the broadcast of `failing_version` fails."""

    def __init__(self, resume: ResumeState | None = None, failing_version: int | None = None,
                 train_fails_at: int | None = None, train_dies_at: int | None = None) -> None:
        self.events: list[str] = []
        self.weights = RecordedWeights(self.events)
        self.resume, self.failing_version, self.train_fails_at = resume, failing_version, train_fails_at
        self.train_dies_at = train_dies_at

    def start_rollout(self, start_step: int, total_steps: int, max_staleness: int, start_version: int) -> None:
        self.events.append(f"rollout from step {start_step} version {start_version}")

    def start_train(self, step: int, publish_version: int) -> RecordedTicket:
        self.events.append(f"submit {step} publish {publish_version}")
        return RecordedTicket(self, step, publish_version)

    def clear_step(self, step: int) -> None:
        self.events.append(f"clear {step}")

    def step_report(self, step: int) -> tuple[dict[str, float], dict]:
        return {}, {"after": step}

    def save_checkpoint(self, state: ResumeState) -> str:
        self.events.append(f"checkpoint {state.step} version {state.weight_version}")
        return f"step_{state.step}"

    def load_checkpoint(self) -> ResumeState | None:
        return self.resume

    def restore_cursor(self, state: dict) -> None:
        self.events.append("restore cursor")

    def dataset_summary(self) -> str:
        return ""

    def shutdown(self) -> None:
        self.events.append("shutdown")


def _run(roles: RecordedRoles, total: int, resume: bool = False) -> InMemorySink:
    sink = InMemorySink()
    run_loop(LoopTables(TrainSpec(steps=total), AlgorithmSpec(max_staleness=1), CheckpointSpec(save_interval=2, resume=resume)),
             roles, sink, StopFlag())
    return sink


def test_the_next_step_is_queued_before_the_result_and_each_broadcast_is_waited_for_in_turn() -> None:
    roles = RecordedRoles()
    sink = _run(roles, total=4)
    assert roles.events == [
        "rollout from step 0 version 0",
        "submit 0 publish 1",
        # step 1 is queued behind step 0 before its result is back; step 0 is cleared at once
        "submit 1 publish 2", "train 0", "clear 0", "post 1",
        # step 2 is a checkpoint: nothing is queued past it until the trainer has saved it
        "train 1", "clear 1", "wait 1", "post 2", "checkpoint 2 version 2", "submit 2 publish 3",
        "submit 3 publish 4", "train 2", "clear 2", "wait 2", "post 3",
        "train 3", "clear 3", "wait 3", "post 4", "checkpoint 4 version 4",
        "wait 4",  # the last broadcast is complete before the loop returns (and shutdown runs)
    ]
    assert [m["weight_version"] for _, m in sink.rows] == [1.0, 2.0, 3.0, 4.0]
    assert all(m["time/sync_s"] == 0.001 and m["time/train_s"] == 0.01 for _, m in sink.rows)


def test_resume_pushes_the_checkpoint_version_and_counts_on_from_it() -> None:
    roles = RecordedRoles(resume=ResumeState(step=4, weight_version=6, data_cursor={}, samples_trained=0))
    _run(roles, total=5, resume=True)
    assert roles.events == [
        "restore cursor", "sync 6", "rollout from step 4 version 6", "submit 4 publish 7",
        "train 4", "clear 4", "post 7", "checkpoint 5 version 7", "wait 7",
    ]


def test_a_stop_lets_the_queued_step_finish_then_checkpoints_it() -> None:
    roles = RecordedRoles()
    stop = StopFlag()

    def stop_after_first(step: int, m: dict[str, float]) -> None:
        stop.requested = step == 1 or stop.requested

    result = run_loop(LoopTables(TrainSpec(steps=6), AlgorithmSpec(max_staleness=1),
                                 CheckpointSpec(save_interval=10, resume=False)),
                      roles, InMemorySink(), stop, stop_after_first)
    assert roles.events[1:] == [
        "submit 0 publish 1", "submit 1 publish 2", "train 0", "clear 0", "post 1",
        "train 1", "clear 1", "wait 1", "post 2", "checkpoint 2 version 2", "wait 2",
    ]
    assert result.end_step == 2 and result.stopped_early and result.last_checkpoint == "step_2"


def test_a_failed_broadcast_fails_the_loop_with_the_channel_error() -> None:
    roles = RecordedRoles(failing_version=2)
    with pytest.raises(WeightChannelError, match=r"weight sync to version 2 failed: sender"):
        _run(roles, total=5)
    assert roles.events[roles.events.index("post 2"):] == [
        "post 2", "checkpoint 2 version 2", "submit 2 publish 3", "submit 3 publish 4",
        "train 2", "clear 2", "wait 2"]


def test_training_starved_by_a_failed_broadcast_reports_the_channel_error() -> None:
    """Rollout waits for the weights a failed broadcast never delivered, so training times out
    first; the loop names the cause, the channel's error, and chains the timeout to it."""
    roles = RecordedRoles(failing_version=2, train_fails_at=2)
    with pytest.raises(WeightChannelError, match=r"weight sync to version 2 failed") as caught:
        _run(roles, total=5)
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert roles.events[-2:] == ["train 2", "wait 2"]


def test_a_dead_role_fails_the_loop_at_once_without_waiting_for_the_broadcast() -> None:
    """A dead trainer rank is the cause itself: the loop neither waits for the broadcast in
    flight (its sender may be the dead rank) nor reports that broadcast's error instead."""
    roles = RecordedRoles(failing_version=2, train_dies_at=2)
    with pytest.raises(RoleDiedError, match=r"^trainer rank 1 died while training step 2"):
        _run(roles, total=5)
    assert roles.events[-1] == "train 2"


def test_training_error_without_a_broadcast_error_is_raised_unchanged() -> None:
    roles = RecordedRoles(train_fails_at=1)
    with pytest.raises(TimeoutError, match="train_1"):
        _run(roles, total=5)
    assert roles.events[-2:] == ["train 1", "wait 1"]


# -- real workers -----------------------------------------------------------------------------


class FailedBroadcast:
    def __init__(self, version: int, message: str) -> None:
        self.version, self.message = version, message

    def wait(self) -> None:
        raise WeightChannelError(self.message)


class BreaksAtVersion:
    """The in-process sync, except that the broadcast of `broken` fails the way the channel's
    does: no receiver gets the weights, each is told the receive failed, `wait()` raises."""

    def __init__(self, inner: Any, broken: int) -> None:
        self.inner, self.broken = inner, broken

    def start(self, version: int) -> Any:
        if version != self.broken:
            return self.inner.start(version)
        for receiver in self.inner.receivers:
            receiver.weights_failed("WeightChannelTimeout: sender rank 0 published nothing")
        return FailedBroadcast(version, CHANNEL_ERROR)

    def sync(self, version: int) -> None:
        self.start(version).wait()


@pytest.mark.slow
def test_in_process_run_with_a_broken_broadcast_fails_with_the_channel_error(
    tiny_model_dir: Path, tmp_path: Path,
) -> None:
    from relax_hpc.driver.run import role_configs
    from relax_hpc.roles.handles import LocalRoles
    from relax_hpc.spec import parse_spec

    spec = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=5, save_interval=50))
    rollout_cfg, actor_cfg = role_configs(spec, tmp_path / "job", "cpu")
    # max_staleness 0: rollout's step 2 needs version 2, whose broadcast fails, so training
    # step 2 starves; the short queue timeout only bounds how long that takes here.
    roles = LocalRoles(rollout_cfg, actor_cfg, timeout_s=5.0)
    roles.weights = BreaksAtVersion(roles.weights, broken=2)
    try:
        with pytest.raises(WeightChannelError, match=r"weight sync to version 2 failed") as caught:
            run_loop(LoopTables(TrainSpec(steps=5), AlgorithmSpec(max_staleness=0),
                                CheckpointSpec(save_interval=50, resume=False)),
                     roles, InMemorySink(), StopFlag())
        # The trainer gave up on step 2's rows because rollout could not get version 2.
        assert "needs weight version 2" in str(caught.value.__cause__)
    finally:
        roles.shutdown()


@pytest.mark.slow
def test_in_process_a_failed_rollout_stops_the_waiting_trainer_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """In one process nothing polls the roles: the producer's failure stops the queue, so the
    trainer waiting for step 1's rows fails with rollout's error rather than its queue timeout."""
    from relax_hpc.driver.run import role_configs
    from relax_hpc.roles.handles import LocalRoles
    from relax_hpc.spec import parse_spec
    from relax_hpc.transfer.queue import TransferAbortedError

    spec = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=3, save_interval=50))
    rollout_cfg, actor_cfg = role_configs(spec, tmp_path / "job", "cpu")
    roles = LocalRoles(rollout_cfg, actor_cfg)  # the trainer's own wait: 600 s

    def generate(step: int) -> Any:
        raise ValueError(f"bad prompt in step {step}")

    roles.rollout.generate = generate  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match=r"rollout producer failed: ValueError: bad prompt in step 0") as caught:
            run_loop(LoopTables(TrainSpec(steps=3), AlgorithmSpec(max_staleness=0),
                                CheckpointSpec(save_interval=50, resume=False)),
                     roles, InMemorySink(), StopFlag())
        assert isinstance(caught.value.__cause__, TransferAbortedError)  # not the 600 s timeout
    finally:
        roles.shutdown()


class QueueServerLog(logging.Handler):
    """The transfer queue server's log lines (its summary of sealed sessions comes at its stop)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def ray_async_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list[str]]:
    """One async run on Ray with max_staleness 1 and the Advantages role, read by three tests (one
    Ray start instead of three). Its rows travel as between nodes (``RELAX_TQ_SHM=0``: TCP, no
    shared memory), each role's session sealed ([security] payload = "encrypt");
    every other Ray run here moves them through shared memory, as on one node."""
    from relax_hpc.driver.run import run_job
    from relax_hpc.spec import parse_spec

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    job = tmp_path_factory.mktemp("ray-async") / "job"
    text = tiny_spec_text(tiny_model_dir, job, steps=8, save_interval=8,
                          extra="[metrics]\ntrajectory_archive = true\n[security]\npayload = \"encrypt\"\n")
    text = text.replace('[job]\nname = "e2e"', '[job]\nname = "e2e"\nmode = "async"')
    text = text.replace('name = "grpo"', 'name = "grpo"\nmax_staleness = 1\ntis_cap = 2.0')
    text = text.replace("micro_batch_size = 256", "micro_batch_size = 256\nadvantages_role = true")
    spec = parse_spec(text)
    assert spec.job.mode == "async" and spec.algorithm.max_staleness == 1 and spec.train.advantages_role
    assert spec.security.payload == "encrypt"
    server_log, logger = QueueServerLog(), logging.getLogger("relax_hpc.transfer.zmq_server")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(server_log)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RELAX_TQ_SHM", "0")  # read by the server here and by each role's client
            report = run_job(spec, in_process=False, progress=False)
    finally:
        logger.removeHandler(server_log)
        logger.setLevel(level)
    return job, report, server_log.lines


@pytest.mark.slow
def test_ray_async_run_keeps_every_sample_within_max_staleness(ray_async_run: tuple[Path, Any, list[str]]) -> None:
    from relax_hpc.ops.archive import read_archive

    job, report, _ = ray_async_run
    assert report.result.end_step == 8
    archive = read_archive(job)
    assert sorted(archive) == list(range(8))
    staleness = {step: sorted({step - row.weight_version for row in rows}) for step, rows in archive.items()}
    # Step s is generated by version >= s - 1: rollout starts step s once step s - 2 is cleared,
    # and waits for the broadcast of the weights trained on it, which may still be on the wire.
    assert all(0 <= lag <= 1 for lags in staleness.values() for lag in lags), staleness
    assert staleness[0] == [0]  # nothing but version 0 exists before the first training step


@pytest.mark.slow
def test_the_advantages_role_runs_as_a_ray_actor_in_async_mode(ray_async_run: tuple[Path, Any, list[str]]) -> None:
    # The trainer asks for `advantages`, which only the role writes: eight steps trained means
    # the role served every step. (tests/driver/test_advantages_e2e.py: the same computation as
    # without the role.)
    _, report, _ = ray_async_run
    assert report.result.end_step == 8 and report.result.samples_trained == 8 * 256


@pytest.mark.slow
def test_over_tcp_every_role_seals_its_rows_and_nothing_is_dropped(ray_async_run: tuple[Path, Any, list[str]]) -> None:
    """The rows of the run above went between the roles as between nodes: every session of the
    driver, rollout, trainer and Advantages role on the sealed data socket, nothing refused."""
    _, report, lines = ray_async_run
    summaries = [line for line in lines if "sealed (encrypt) on the data socket" in line]
    assert len(summaries) == 1, lines  # one server, one summary at its stop
    sealed = int(summaries[0].split("transfer queue: ")[1].split(" session")[0])
    assert sealed >= 4, summaries  # the driver's own client and one per role at least
    assert "; 0 message(s) there did not open" in summaries[0], summaries
    assert report.result.samples_trained == 8 * 256
