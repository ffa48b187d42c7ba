"""Experiment-tracker sinks: Weights & Biases, ClearML and MLflow, offline by default.

Offline, each writes only into the job directory (`JOBDIR/wandb`, `JOBDIR/clearml`,
`JOBDIR/mlflow`), never into the home directory, and needs no server, network or credentials;
the runs are uploaded later (docs/operations.md, "Metrics sinks"). This is the only module that
imports wandb, clearml or mlflow. `read_wandb_history`, `read_clearml_scalars` and
`read_mlflow_history` read back what the sinks wrote, to check an offline run before uploading
it (and for the tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import secrets
import signal
import string
import struct
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from relax_hpc.spec.schema import MetricsSpec

log = logging.getLogger(__name__)

# (spec key that turns it on, package) for each tracker.
TRACKER_PACKAGES = (("wandb_project", "wandb"), ("clearml_project", "clearml"), ("mlflow_experiment", "mlflow"))


def require_trackers(metrics: MetricsSpec) -> None:
    """Refuse, before anything starts, a tracker the spec turns on whose package is missing."""
    for key, package in TRACKER_PACKAGES:
        if getattr(metrics, key) and importlib.util.find_spec(package) is None:
            raise RuntimeError(
                f"[metrics] {key} = {getattr(metrics, key)!r} needs the {package} package, which is not "
                f"installed here; pip install 'relax-hpc[trackers]' (or unset {key})")


@contextlib.contextmanager
def driver_handlers_kept() -> Iterator[None]:
    """Put back the signal handlers and excepthook a tracker's start-up replaced.

    ClearML installs its own SIGINT/SIGTERM handlers on start; the driver's (finish the step,
    checkpoint, stop: driver/run.py) must stay in charge. The sinks are closed by the driver.
    """
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()} if main else {}
    excepthook = sys.excepthook
    try:
        yield
    finally:
        sys.excepthook = excepthook
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def _write_new_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class WandbSink:
    """A W&B run in `directory/wandb/`; offline (the default) it needs no account or network.

    The run id is kept in `directory/wandb/run_id`, so a requeued job continues the same run:
    each start adds an `offline-run-<time>-<id>/` folder, and `wandb sync` uploads them as one
    run. W&B's cache and data folders (offline its config folder too) are moved there as well,
    through env vars of this process.
    """

    def __init__(self, project: str, run_name: str, config: dict[str, Any], directory: Path,
                 mode: Literal["offline", "online"] = MetricsSpec.wandb_mode) -> None:
        import wandb

        root = directory / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        os.environ.update(WANDB_MODE=mode, WANDB_DIR=str(directory), WANDB_CACHE_DIR=str(root / ".cache"),
                          WANDB_DATA_DIR=str(root / ".data"))
        if mode == "offline":  # online keeps the user's settings (a self-hosted server's address)
            os.environ["WANDB_CONFIG_DIR"] = str(root / ".config")
        id_file = root / "run_id"
        if id_file.is_file():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
            _write_new_text(id_file, run_id + "\n")
        self.run_id = run_id
        # console off: the driver's own output stays as it is; no system-stats process, no pip
        # freeze or code copy per start.
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True,
                                  x_disable_stats=True, x_disable_machine_info=True,
                                  x_save_requirements=False)
        with driver_handlers_kept():
            self._run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", config=config,
                                   dir=str(directory), mode=mode, settings=settings)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() can return before W&B's service process has written the end of the run's
        # file; teardown waits for it (and stops that process).
        wandb.teardown()


# ClearML's reporter runs in a forked subprocess by default; forking the driver (threads, Ray)
# is unsafe, and closing waits ~10 s on it. Offline there is no server to configure.
CLEARML_CONF = "sdk { development { report_use_subprocess: false } }\n"
# How long `ClearMLSink.close` waits for ClearML's writer thread to put the last scalars into the
# session folder (it takes milliseconds on a quiet machine).
CLEARML_CLOSE_WAIT_S = 60.0


class ClearMLSink:
    """A ClearML task in offline mode: its session folder is `directory/clearml/offline/<task id>/`
    (zipped next to it on close), no server, network or credentials.

    Each start is a new offline task; `Task.import_offline_session` uploads it later, onto an
    earlier one with `previous_task_id`. A scalar "reward/mean" is reported as title "reward",
    series "mean"; a name without "/" as title and series both.
    """

    def __init__(self, project: str, task_name: str, directory: Path) -> None:
        root = directory / "clearml"
        root.mkdir(parents=True, exist_ok=True)
        conf = root / "clearml.conf"
        _write_new_text(conf, CLEARML_CONF)
        # Read when clearml first loads its configuration (at the first Task.init of the process).
        os.environ.update(CLEARML_CACHE_DIR=str(root), CLEARML_OFFLINE_MODE="1", CLEARML_CONFIG_FILE=str(conf))
        from clearml import Task
        from clearml.config.cache import SessionCache

        # Its task-reuse cache is ~/.clearml/.session.json, with no env var to move it.
        SessionCache.SESSION_CACHE_FOLDER = str(root / "session")
        Task.set_offline(True)
        with driver_handlers_kept():
            self._task: Any = Task.init(
                project_name=project, task_name=task_name, reuse_last_task_id=False, continue_last_task=False,
                auto_connect_frameworks=False, auto_connect_arg_parser=False, auto_connect_streams=False,
                auto_resource_monitoring=False, output_uri=False)
        self.session = Path(self._task.get_offline_mode_folder())
        self._logger: Any = self._task.get_logger()
        self._reported = 0  # scalars handed to ClearML: what the closed session must hold

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            title, _, series = name.partition("/")
            self._logger.report_scalar(title, series or title, float(value), iteration=step)
            self._reported += 1

    def close(self) -> None:
        """Close the task, then make sure the session holds every scalar reported.

        ClearML writes the events from a thread of its own and zips the session folder when the
        task closes; on a loaded machine the last write once landed after the zip (and after
        close returned), so the zip, which is what gets imported, lacked them. Close waits for the
        folder to hold them all, then zips it again (write, then rename) if the zip missed some.
        """
        self._task.close()
        folder = self.session / "metrics.jsonl"
        deadline = time.monotonic() + CLEARML_CLOSE_WAIT_S
        while (written := _count_scalars(_read_if_there(folder))) < self._reported:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ClearML wrote {written} of the {self._reported} scalars reported into {folder} within "
                    f"{CLEARML_CLOSE_WAIT_S:g} s of closing its task; the offline session lacks the rest")
            time.sleep(0.1)
        archive = self.session.with_suffix(".zip")
        if _count_scalars(_zip_member(archive, "metrics.jsonl")) < self._reported:
            _zip_folder(self.session, archive)


# MLflow refuses its file store unless this is set (it is in maintenance mode there, still
# supported); offline on a compute node it is the store that needs no server and no database.
# Telemetry off: a run reports to no one but its own store.
MLFLOW_OFFLINE_ENV = {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
# What MLflow takes in one log_batch call, and the longest param value it keeps.
_MLFLOW_BATCH_METRICS, _MLFLOW_BATCH_PARAMS, _MLFLOW_PARAM_CHARS = 1000, 100, 6000
_MLFLOW_BAD_NAME_CHARS = re.compile(r"[^\w./\- :]")


def default_mlflow_uri(directory: Path) -> str:
    """The file store a run uses when `[metrics] mlflow_tracking_uri` is unset."""
    return (directory / "mlflow" / "mlruns").absolute().as_uri()


def without_credentials(uri: str) -> str:
    """`uri` with a user name and password in it shown as `***` (they belong in
    MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN, not in the spec)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def flat_params(tables: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved spec as MLflow params: `rollout.max_new_tokens` -> "4"; lists as JSON, unset
    keys left out, values cut to what MLflow keeps. The tracking URI's credentials are hidden."""
    out: dict[str, str] = {}
    for key, value in tables.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, f"{name}."))
        elif value is not None:
            text = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
            if name == "metrics.mlflow_tracking_uri":
                text = without_credentials(text)
            out[name] = text[:_MLFLOW_PARAM_CHARS]
    return out


def mlflow_metric_name(name: str) -> str:
    """`name` as MLflow accepts it: characters it refuses become "_"."""
    return _MLFLOW_BAD_NAME_CHARS.sub("_", name)


class MlflowSink:
    """An MLflow run in experiment `experiment`; by default in a file store under
    `directory/mlflow/mlruns`, which needs no server, network or credentials.

    The run id is kept in `directory/mlflow/run_id`, so a requeued job continues the same run (a
    step trained again is logged again: its history then holds both values, the later last).
    The run's params are the resolved spec's keys; a key whose value changed since the run
    began keeps its first value (MLflow params cannot change) and a warning names it.
    """

    def __init__(self, experiment: str, run_name: str, spec_tables: dict[str, Any], directory: Path,
                 tracking_uri: str | None = None) -> None:
        root = directory / "mlflow"
        root.mkdir(parents=True, exist_ok=True)
        os.environ.update(MLFLOW_OFFLINE_ENV)  # read when mlflow is imported and its store opened
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri or default_mlflow_uri(directory)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
        id_file = root / "run_id"
        run = None
        if id_file.is_file():
            try:
                run = self._client.get_run(id_file.read_text(encoding="utf-8").strip())
            except MlflowException:
                run = None  # another store (the URI changed) or a deleted run: start a new one
        if run is None or run.info.experiment_id != experiment_id:
            run = self._client.create_run(experiment_id, run_name=run_name)
            _write_new_text(id_file, run.info.run_id + "\n")
        else:
            self._client.update_run(run.info.run_id, status="RUNNING")
        self.run_id: str = run.info.run_id
        logged = run.data.params
        params = flat_params(spec_tables)
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("MLflow run %s keeps the first values of params %s: MLflow params cannot change "
                        "(spec.toml has this run's)", self.run_id, ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), _MLFLOW_BATCH_PARAMS):
            self._client.log_batch(self.run_id, params=new[i:i + _MLFLOW_BATCH_PARAMS])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_metric_name(k), float(v), now_ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_BATCH_METRICS])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


# The .wandb file: W&B's transaction log in the LevelDB log format (a 7-byte file header, then
# 32 KiB blocks of records, each a 7-byte header (crc32, length, type) and a piece of one
# protobuf `Record`).
_WANDB_HEADER = struct.Struct("<4sHB")  # b":W&B", 0xBEE1, version 0
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, magic, _version = _WANDB_HEADER.unpack_from(data)
    if (ident, magic) != (b":W&B", 0xBEE1):
        raise ValueError(f"{path} is not a W&B transaction log (header {data[:7]!r})")
    pos, pieces = _WANDB_HEADER.size, b""
    while pos + _RECORD_HEADER.size <= len(data):
        if _BLOCK - pos % _BLOCK < _RECORD_HEADER.size:  # a block's tail too short for a header
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        pos += _RECORD_HEADER.size
        piece, pos = data[pos:pos + length], pos + length
        if kind == _FULL:
            yield piece
        elif kind == _FIRST:
            pieces = piece
        elif kind == _MIDDLE:
            pieces += piece
        elif kind == _LAST:
            yield pieces + piece


def read_wandb_history(directory: Path) -> dict[int, dict[str, float]]:
    """{step: {name: value}} from every run under `directory/wandb/` (W&B's own `_step`,
    `_runtime`, ... left out); when a requeued run logged a step again, its later value wins."""
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict[str, float]] = {}
    for path in sorted((directory / "wandb").glob("*run-*/run-*.wandb")):  # by start time
        for raw in _wandb_records(path):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = int(items.get("_step", record.history.step.num))
            history.setdefault(step, {}).update(
                {k: float(v) for k, v in items.items() if not k.startswith("_")})
    return history


def _clearml_scalars(text: str) -> Iterator[dict[str, Any]]:
    """The scalar events of an offline session's metrics.jsonl (a JSON list of events a line)."""
    for line in text.splitlines():
        for event in json.loads(line) if line.strip() else []:
            if event.get("type") == "training_stats_scalar":
                yield event


def _count_scalars(text: str) -> int:
    return sum(1 for _ in _clearml_scalars(text))


def _read_if_there(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def _zip_member(archive: Path, name: str) -> str:
    """`name` inside the zip `archive`, "" when either is missing."""
    try:
        with zipfile.ZipFile(archive) as zf:
            return zf.read(name).decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile):
        return ""


def _zip_folder(folder: Path, archive: Path) -> None:
    """Zip every file under `folder`, named relative to it (as ClearML zips a session)."""
    tmp = archive.with_name(archive.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", allowZip64=True, compression=zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, arcname=path.relative_to(folder).as_posix())
    os.replace(tmp, archive)


def read_clearml_scalars(directory: Path) -> dict[int, dict[str, float]]:
    """{step: {name: value}} from every offline session under `directory/clearml/offline/`
    ("title/series", or the title alone where both are the same), oldest session first."""
    history: dict[int, dict[str, float]] = {}
    sessions = sorted((directory / "clearml" / "offline").glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    for path in sessions:
        for event in _clearml_scalars(path.read_text(encoding="utf-8")):
            title, series = event["metric"], event["variant"]
            name = title if series == title else f"{title}/{series}"
            history.setdefault(int(event["iter"]), {})[name] = float(event["value"])
    return history


def read_mlflow_history(directory: Path, tracking_uri: str | None = None) -> dict[int, dict[str, float]]:
    """{step: {name: value}} of the job's MLflow run (its id in `directory/mlflow/run_id`), read
    by MLflow's own client; when a requeued run logged a step again, the later value wins."""
    os.environ.update(MLFLOW_OFFLINE_ENV)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri or default_mlflow_uri(directory))
    run_id = (directory / "mlflow" / "run_id").read_text(encoding="utf-8").strip()
    history: dict[int, dict[str, float]] = {}
    for name in client.get_run(run_id).data.metrics:
        # In the order logged (timestamp, then the order of the store's lines).
        for metric in sorted(client.get_metric_history(run_id, name), key=lambda m: m.timestamp):
            history.setdefault(int(metric.step), {})[name] = float(metric.value)
    return dict(sorted(history.items()))
