"""W&B, ClearML and MLflow sinks, offline: write steps, close, then read back what they wrote.

W&B's run is read from its transaction log (JOBDIR/wandb/offline-run-*/run-<id>.wandb, records in
W&B's protobuf format); ClearML's from its offline session (JOBDIR/clearml/offline/<task>/
metrics.jsonl, and the zip that is imported later); MLflow's by its own client from the file store
(JOBDIR/mlflow/mlruns). No server, network or home directory.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from offline_trackers import needs_clearml, needs_mlflow, needs_wandb, offline_sandbox

from relax_hpc.ops.trackers import (
    ClearMLSink,
    MlflowSink,
    WandbSink,
    default_mlflow_uri,
    flat_params,
    mlflow_metric_name,
    read_clearml_scalars,
    read_mlflow_history,
    read_wandb_history,
    require_trackers,
    without_credentials,
)
from relax_hpc.spec import JobSpec, parse_spec, spec_to_dict
from relax_hpc.spec.schema import MetricsSpec

REPO = Path(__file__).resolve().parents[2]

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


# A token in the [notify] URL (a secret the spec redacts) and a password in the tracking URI.
NOTIFY_TOKEN = "tk_9f2c71d0a4"
TRACKING_PASSWORD = "pw-61b8e3"


def tiny_spec(job: Path, tracking_uri: str | None = None) -> JobSpec:
    text = (REPO / "relax_hpc" / "jobspecs" / "tiny_local.toml").read_text()
    uri = f'\nmlflow_tracking_uri = "{tracking_uri}"' if tracking_uri else ""
    text = text.replace("trajectory_archive = true", f'mlflow_experiment = "relax-test"{uri}')
    text += f'\n[notify]\nurls = ["ntfy://ntfy.sh/{NOTIFY_TOKEN}"]\n'
    spec = parse_spec(text)
    return dataclasses.replace(spec, job=dataclasses.replace(spec.job, output_dir=str(job)))


def mlflow_client(job: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=default_mlflow_uri(job))


@needs_mlflow
def test_mlflow_file_store_reads_back_every_step_and_the_spec_as_params(job: Path) -> None:
    spec = tiny_spec(job)
    sink = MlflowSink("relax-test", "tiny", spec_to_dict(spec), job)
    for step in (1, 2, 3):
        sink.log(step, scalars(step))
    sink.close()

    assert sink.tracking_uri == (job / "mlflow" / "mlruns").as_uri()
    client = mlflow_client(job)
    run = client.get_run(sink.run_id)
    assert (run.info.run_name, run.info.status) == ("tiny", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "relax-test"
    for name in scalars(1):  # MLflow's own history of each key: every step, as logged
        assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, name)] == [
            (step, scalars(step)[name]) for step in (1, 2, 3)]
    assert read_mlflow_history(job) == {step: scalars(step) for step in (1, 2, 3)}

    params = run.data.params
    assert params == flat_params(spec_to_dict(spec))
    assert params["rollout.n_samples_per_prompt"] == "32" and params["job.name"] == "tiny_local"
    assert params["metrics.mlflow_experiment"] == "relax-test"
    assert json.loads(params["notify.urls"]) == ["ntfy://ntfy.sh/***"]
    assert not any(NOTIFY_TOKEN in v for v in params.values())
    assert (job / "mlflow" / "run_id").read_text().strip() == sink.run_id


@needs_mlflow
def test_a_requeued_job_continues_the_same_mlflow_run(job: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = tiny_spec(job)
    first = MlflowSink("relax-test", "tiny", spec_to_dict(spec), job)
    for step in (1, 2, 3):
        first.log(step, scalars(step))
    first.close()
    # Resumed from the checkpoint of step 2, with more steps: step 3 is trained (and logged) again.
    longer = dataclasses.replace(spec, train=dataclasses.replace(spec.train, steps=800))
    second = MlflowSink("relax-test", "tiny", spec_to_dict(longer), job)
    assert mlflow_client(job).get_run(second.run_id).info.status == "RUNNING"
    for step in (3, 4):
        second.log(step, {**scalars(step), "reward/mean": 10.0 + step})
    second.close()

    assert second.run_id == first.run_id
    client = mlflow_client(job)
    assert len(client.search_runs([client.get_run(first.run_id).info.experiment_id])) == 1
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "reward/mean")] == [
        (1, 1 / 8), (2, 2 / 8), (3, 3 / 8), (3, 13.0), (4, 14.0)]
    history = read_mlflow_history(job)
    assert sorted(history) == [1, 2, 3, 4] and history[3]["reward/mean"] == 13.0  # the later one wins
    assert client.get_run(first.run_id).data.params["train.steps"] == "400"  # params cannot change
    assert any("keeps the first values of params train.steps" in r.getMessage() for r in caplog.records)


def test_mlflow_params_hide_the_tracking_uris_credentials_and_names_mlflow_refuses() -> None:
    uri = f"https://alice:{TRACKING_PASSWORD}@mlflow.example.org:5000/prefix"
    assert without_credentials(uri) == "https://***@mlflow.example.org:5000/prefix"
    assert without_credentials("file:///scratch/runs/mlruns") == "file:///scratch/runs/mlruns"
    params = flat_params({"metrics": {"mlflow_tracking_uri": uri, "wandb_project": None},
                          "notify": {"events": ["started", "failed"]}, "train": {"lr": 0.0005}})
    assert params == {"metrics.mlflow_tracking_uri": "https://***@mlflow.example.org:5000/prefix",
                      "notify.events": '["started", "failed"]', "train.lr": "0.0005"}
    assert flat_params({"data": {"path": "x" * 7000}})["data.path"] == "x" * 6000  # MLflow keeps 6000
    # A "module:function" reward's counter keeps its colon; characters MLflow refuses become "_".
    assert mlflow_metric_name("reward/count/my_rewards:score") == "reward/count/my_rewards:score"
    assert mlflow_metric_name("reward/count/ünïcode ok") == "reward/count/ünïcode ok"
    assert mlflow_metric_name("rollout/by_media/image+video") == "rollout/by_media/image_video"


def test_mlflow_without_its_package_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError) as refused:
        require_trackers(MetricsSpec(mlflow_experiment="e"))
    assert "[metrics] mlflow_experiment = 'e' needs the mlflow package" in str(refused.value)
