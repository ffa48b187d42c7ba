"""Metrics sinks: every step's scalars go to each configured sink (JSONL, TensorBoard, memory).

Each sink implements `log(step, scalars)` and `close()`; `FanOut` sends to all of them. Only the
TensorBoard sink imports its library (and W&B / ClearML sinks import theirs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


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


class WandbSink:
    def __init__(self, project: str, run_name: str, config: dict) -> None:
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(
                "[metrics] wandb_project is set but wandb is not installed; pip install 'relax-hpc[wandb]'"
            ) from e
        self._run = wandb.init(project=project, name=run_name, config=config, resume="allow")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class FanOut:
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, scalars)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Read a metrics JSONL; when a resumed run repeated a step, its last record wins."""
    by_step: dict[int, dict[str, float]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]
