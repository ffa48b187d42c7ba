"""Metrics sinks: every step's scalars go to each configured sink (JSONL, TensorBoard, memory;
W&B and ClearML in ops/trackers.py).

Each sink implements `log(step, scalars)` and `close()`; `FanOut` sends to all of them, and a
failing sink never stops training. Only the TensorBoard sink imports its library here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class InMemorySink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.rows.append((step, dict(scalars)))

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per step; a resumed run keeps appending to the same file.

    Each record is flushed to the OS (it survives the process dying); no fsync per step, which
    would put a disk round trip on the training loop's critical path.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = path.open("a", encoding="utf-8")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, **scalars}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # The writer flushes on its own thread every flush_secs; flushing per step would stall
        # the training loop on file I/O.
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class FanOut:
    """Sends every step to each sink. A sink that raises never stops training: the error is
    counted for that sink (`failures()`, `metrics/sink_failures` in summary.json), logged once
    with the error, and the other sinks still get every step; close says how many more failed.
    """

    def __init__(self, sinks: Sequence[MetricsSink] | Mapping[str, MetricsSink]) -> None:
        named = dict(sinks) if isinstance(sinks, Mapping) else _names_by_class(sinks)
        self.sinks = list(named.values())
        self._named = named
        self._failures = dict.fromkeys(named, 0)

    @classmethod
    def open(cls, builders: Mapping[str, Callable[[], MetricsSink]]) -> FanOut:
        """Build each sink; one that fails to start is logged, and every step counts as a failure
        for it, while the others run."""
        sinks: dict[str, MetricsSink] = {}
        for name, build in builders.items():
            try:
                sinks[name] = build()
            except Exception as error:  # noqa: BLE001 - a sink never stops training
                log.warning("metrics sink %s did not start (%r); training goes on without it", name, error)
                sinks[name] = _NotStarted(error)
        fan_out = cls(sinks)
        for name, sink in sinks.items():
            if isinstance(sink, _NotStarted):
                fan_out._failures[name] = 1
        return fan_out

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, sink in self._named.items():
            try:
                sink.log(step, scalars)
            except Exception as error:  # noqa: BLE001 - a sink never stops training
                self._failed(name, f"step {step}", error)

    def close(self) -> None:
        for name, sink in self._named.items():
            try:
                sink.close()
            except Exception as error:  # noqa: BLE001 - a sink never stops training
                self._failed(name, "close", error)
            if self._failures[name] > 1:
                log.warning("metrics sink %s: %d calls failed in all (steps it did not record, or its close)",
                            name, self._failures[name])

    def failures(self) -> dict[str, int]:
        """Failed calls per sink (0 for each sink that recorded everything)."""
        return dict(self._failures)

    def _failed(self, name: str, where: str, error: Exception) -> None:
        self._failures[name] += 1
        if self._failures[name] == 1:
            log.warning("metrics sink %s failed at %s (%r); training goes on, its further failures are "
                        "counted (summary.json: metrics/sink_failures)", name, where, error)


class _NotStarted:
    """Stands for a sink whose constructor raised: every call fails with that error."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise RuntimeError(f"it did not start: {self.error!r}")

    def close(self) -> None:
        pass


def _names_by_class(sinks: Sequence[MetricsSink]) -> dict[str, MetricsSink]:
    named: dict[str, MetricsSink] = {}
    for sink in sinks:
        name = base = type(sink).__name__
        n = 1
        while name in named:
            n += 1
            name = f"{base}#{n}"
        named[name] = sink
    return named


def read_metrics(path: Path, *, partial_last_line_ok: bool = False) -> list[dict[str, float]]:
    """Read a metrics JSONL; when a resumed run repeated a step, its last record wins.

    `partial_last_line_ok`: the file is being written (a plot drawn during the run), so a last
    line without its newline may be a record cut short; it is left out when it does not parse.
    """
    by_step: dict[int, dict[str, float]] = {}
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    lines = text.splitlines()
    unfinished = lines.pop() if partial_last_line_ok and lines and not text.endswith("\n") else None
    for line in lines:
        if line.strip():
            row = json.loads(line)
            by_step[int(row["step"])] = row
    if unfinished is not None:
        try:
            row = json.loads(unfinished)
            by_step[int(row["step"])] = row
        except ValueError:
            pass  # the rest of it is still being written
    return [by_step[s] for s in sorted(by_step)]
