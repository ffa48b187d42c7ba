"""W&B and ClearML sinks, offline: write steps, close, then read back what they wrote.

W&B's run is read from its transaction log (JOBDIR/wandb/offline-run-*/run-<id>.wandb, records in
W&B's protobuf format); ClearML's from its offline session (JOBDIR/clearml/offline/<task>/
metrics.jsonl, and the zip that is imported later). No server, network or home directory.
"""

from __future__ import annotations

import json
import signal
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from offline_trackers import needs_clearml, needs_wandb, offline_sandbox

from relax_hpc.ops.trackers import (
    ClearMLSink,
    WandbSink,
    read_clearml_scalars,
    read_wandb_history,
    require_trackers,
)
from relax_hpc.spec.schema import MetricsSpec

# clearml's bundled config parser calls pyparsing by its old, deprecated names.
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated.*use:DeprecationWarning")


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    with offline_sandbox(monkeypatch, tmp_path / "home"):
        yield tmp_path / "job"


def scalars(step: int) -> dict[str, float]:
    # A "/" in a name, two of them, and none; the values a step's metrics look like.
    return {"reward/mean": step / 8, "train/loss/total": -0.25 * step, "weight_version": float(step)}


@needs_wandb
def test_wandb_offline_run_reads_back_every_step(job: Path) -> None:
    sink = WandbSink("relax-test", "tiny", {"rollout": {"n_samples_per_prompt": 4}}, job)
    # 300 steps make the log longer than one 32 KiB block, so records are split across blocks.
    for step in range(1, 301):
        sink.log(step, scalars(step))
    sink.close()

    assert read_wandb_history(job) == {step: scalars(step) for step in range(1, 301)}
    logs = list((job / "wandb").glob(f"offline-run-*-{sink.run_id}/run-{sink.run_id}.wandb"))
    assert len(logs) == 1 and logs[0].stat().st_size > 32 * 1024
    assert (job / "wandb" / "run_id").read_text().strip() == sink.run_id


@needs_wandb
def test_a_requeued_job_continues_the_same_wandb_run(job: Path) -> None:
    first = WandbSink("relax-test", "tiny", {}, job)
    for step in (1, 2, 3):
        first.log(step, scalars(step))
    first.close()
    # Resumed from the checkpoint of step 2: step 3 is trained (and logged) again.
    second = WandbSink("relax-test", "tiny", {}, job)
    for step in (3, 4):
        second.log(step, {**scalars(step), "reward/mean": 10.0 + step})
    second.close()

    assert second.run_id == first.run_id
    assert len(list((job / "wandb").glob(f"offline-run-*-{first.run_id}*/run-{first.run_id}.wandb"))) == 2
    history = read_wandb_history(job)
    assert sorted(history) == [1, 2, 3, 4]
    assert history[2]["reward/mean"] == 2 / 8 and history[3]["reward/mean"] == 13.0  # the later one wins


@needs_clearml
def test_clearml_offline_session_reads_back_every_step(job: Path) -> None:
    sink = ClearMLSink("relax-test", "tiny", job)
    for step in (1, 2, 3):
        sink.log(step, scalars(step))
    sink.close()

    assert sink.session.parent == job / "clearml" / "offline"
    assert read_clearml_scalars(job) == {step: scalars(step) for step in (1, 2, 3)}
    # "reward/mean" went in as title "reward", series "mean"; the zip holds what is imported.
    with zipfile.ZipFile(sink.session.with_suffix(".zip")) as zf:
        events = [e for line in zf.read("metrics.jsonl").decode().splitlines() for e in json.loads(line)]
        task = json.loads(zf.read("task.json"))
    assert {(e["metric"], e["variant"]) for e in events} == {
        ("reward", "mean"), ("train", "loss/total"), ("weight_version", "weight_version")}
    assert (task["project_name"], task["name"]) == ("relax-test", "tiny")


def _zipped_steps(archive: Path) -> set[int]:
    with zipfile.ZipFile(archive) as zf:
        text = zf.read("metrics.jsonl").decode() if "metrics.jsonl" in zf.namelist() else ""
    return {int(e["iter"]) for line in text.splitlines() for e in json.loads(line)}


@needs_clearml
def test_clearml_scalars_written_after_its_zip_still_reach_the_zip(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a loaded machine did once (2026-12-01): ClearML's writer put the scalars into the
    # session folder after the task had closed and zipped it. Here each of its writes goes to a
    # file outside the session and lands in the session's metrics.jsonl 1.5 s later.
    import threading

    from clearml.backend_interface.metrics.interface import Metrics

    write = Metrics._do_write_events
    landings: list[threading.Timer] = []

    def write_late(self: Any, *args: Any, **kwargs: Any) -> Any:
        session_file = self._offline_log_filename
        held = session_file.parent.parent / f"held-{len(landings)}.jsonl"
        self._offline_log_filename = held
        try:
            result = write(self, *args, **kwargs)
        finally:
            self._offline_log_filename = session_file

        def land() -> None:
            with open(session_file, "a", encoding="utf-8") as out:
                out.write(held.read_text(encoding="utf-8"))

        landings.append(threading.Timer(1.5, land))
        landings[-1].start()
        return result

    monkeypatch.setattr(Metrics, "_do_write_events", write_late)
    sink = ClearMLSink("relax-test", "tiny", job)
    for step in (1, 2, 3):
        sink.log(step, scalars(step))
    sink.close()

    assert landings, "ClearML wrote no events through Metrics._do_write_events: the test no longer delays them"
    assert read_clearml_scalars(job) == {step: scalars(step) for step in (1, 2, 3)}
    assert _zipped_steps(sink.session.with_suffix(".zip")) == {1, 2, 3}


@needs_clearml
def test_clearml_leaves_the_drivers_signal_handlers_in_place(job: Path) -> None:
    def handler(signum: int, frame: Any) -> None:
        pass

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        sink = ClearMLSink("relax-test", "tiny", job)
        assert all(signal.getsignal(sig) is handler for sig in before)
        sink.close()
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def test_a_tracker_without_its_package_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    require_trackers(MetricsSpec())  # nothing turned on: nothing needed
    with pytest.raises(RuntimeError) as refused:
        require_trackers(MetricsSpec(clearml_project="p"))
    assert "[metrics] clearml_project = 'p' needs the clearml package" in str(refused.value)
    assert "pip install 'relax-hpc[trackers]'" in str(refused.value)
