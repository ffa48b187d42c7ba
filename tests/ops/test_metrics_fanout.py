"""FanOut: a sink that fails never stops training; it is counted and warned about once."""

from __future__ import annotations

import logging

import pytest

from relax_hpc.ops.metrics import FanOut, InMemorySink


class Broken:
    """Fails to log steps 2 and 3 (a full disk, a dead connection), and to close."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step in (2, 3):
            raise OSError(f"no space left (step {step})")

    def close(self) -> None:
        raise OSError("close failed")


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_failing_sink_is_counted_warned_once_and_the_others_get_every_step(
        caplog: pytest.LogCaptureFixture) -> None:
    memory = InMemorySink()
    fan_out = FanOut({"jsonl": memory, "wandb": Broken()})
    with caplog.at_level(logging.WARNING, logger="relax_hpc.ops.metrics"):
        for step in (1, 2, 3, 4):
            fan_out.log(step, {"reward/mean": step / 4})
        assert fan_out.failures() == {"jsonl": 0, "wandb": 2}
        assert len(warnings_of(caplog)) == 1
        fan_out.close()

    assert [step for step, _ in memory.rows] == [1, 2, 3, 4]
    assert fan_out.failures() == {"jsonl": 0, "wandb": 3}  # steps 2 and 3, and close
    first, total = warnings_of(caplog)
    assert "metrics sink wandb failed at step 2" in first and "no space left (step 2)" in first
    assert "metrics sink wandb: 3 calls failed in all" in total


def test_a_sink_that_does_not_start_leaves_the_others_running(caplog: pytest.LogCaptureFixture) -> None:
    memory = InMemorySink()

    def no_server() -> InMemorySink:
        raise ConnectionError("no tracker server")

    with caplog.at_level(logging.WARNING, logger="relax_hpc.ops.metrics"):
        fan_out = FanOut.open({"jsonl": lambda: memory, "clearml": no_server})
        for step in (1, 2):
            fan_out.log(step, {"reward/mean": 0.5})
        fan_out.close()

    assert [step for step, _ in memory.rows] == [1, 2]
    assert fan_out.failures() == {"jsonl": 0, "clearml": 3}  # the start and both steps
    started, total = warnings_of(caplog)
    assert "metrics sink clearml did not start" in started and "no tracker server" in started
    assert "3 calls failed in all" in total


def test_unnamed_sinks_are_named_by_their_class() -> None:
    fan_out = FanOut([InMemorySink(), InMemorySink(), Broken()])
    assert fan_out.failures() == {"InMemorySink": 0, "InMemorySink#2": 0, "Broken": 0}
