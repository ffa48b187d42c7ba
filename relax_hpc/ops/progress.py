"""Progress of a run: a tqdm bar on a terminal, a plain line every N seconds in a log file.

    progress = make_progress(total=400, desc="tiny_local")
    progress.update(step, reward, step_s)   # after every step
    progress.close()

A job log (Slurm's output file, or any stderr that is not a terminal) gets lines like

    step 120/400  reward 0.513  1.42 s/step  eta 6m40s

every $RELAX_HPC_PROGRESS_EVERY_S seconds (default 30), then one last line when the run ends,
instead of a bar redrawn with carriage returns. s/step is the mean since the previous line.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Protocol, TextIO

__all__ = ["EVERY_S_ENV", "LineProgress", "NoProgress", "Progress", "TqdmProgress", "every_s_from_env",
           "format_duration", "make_progress"]

EVERY_S_ENV = "RELAX_HPC_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 30.0


class Progress(Protocol):
    def update(self, step: int, reward: float, step_s: float) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    """--no-progress: nothing at all."""

    def update(self, step: int, reward: float, step_s: float) -> None:
        pass

    def close(self) -> None:
        pass


class TqdmProgress:
    """The bar for a terminal: step, reward and the last step's seconds as its postfix."""

    def __init__(self, total: int, desc: str, stream: TextIO) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=stream)

    def update(self, step: int, reward: float, step_s: float) -> None:
        self._bar.n = step
        self._bar.set_postfix(reward=f"{reward:.3f}", s_per_step=f"{step_s:.2f}")

    def close(self) -> None:
        self._bar.close()


def format_duration(seconds: float) -> str:
    """400 -> '6m40s', 45 -> '45s', 7320 -> '2h02m'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class LineProgress:
    """One line every ``every_s`` seconds of ``clock``, and one at :meth:`close` if anything is new."""

    def __init__(self, total: int, every_s: float, stream: TextIO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.every_s, self.stream, self.clock = total, every_s, stream, clock
        self._started = self._line_at = clock()
        self._line_step: int | None = None  # step of the previous line; None until the first update
        self._step, self._reward, self._s_per_step = 0, 0.0, 0.0

    def update(self, step: int, reward: float, step_s: float) -> None:
        if self._line_step is None:
            self._line_step = step - 1  # a resumed run starts counting at its checkpoint
        self._step, self._reward = step, reward
        now = self.clock()
        if now - self._line_at >= self.every_s:
            rate = self._rate(now)
            self._write(now, rate, f"eta {format_duration((self.total - step) * rate)}")

    def close(self) -> None:
        if self._line_step is not None and self._step > self._line_step:
            now = self.clock()
            self._write(now, self._rate(now), f"ran {format_duration(now - self._started)}")

    def _rate(self, now: float) -> float:
        """Mean seconds per step since the previous line (the previous mean if no step since)."""
        assert self._line_step is not None, "update() sets it before any line"
        done = self._step - self._line_step
        if done > 0:
            self._s_per_step = (now - self._line_at) / done
        return self._s_per_step

    def _write(self, now: float, s_per_step: float, tail: str) -> None:
        print(f"step {self._step}/{self.total}  reward {self._reward:.3f}  {s_per_step:.2f} s/step  {tail}",
              file=self.stream, flush=True)
        self._line_at, self._line_step = now, self._step


def every_s_from_env(env: Mapping[str, str], stream: TextIO) -> float:
    """Seconds between lines from $RELAX_HPC_PROGRESS_EVERY_S; a bad value warns and keeps the default."""
    raw = env.get(EVERY_S_ENV, "")
    if not raw:
        return DEFAULT_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also rejects nan
        print(f"{EVERY_S_ENV}={raw!r} ignored: expected seconds between progress lines, a number >= 0 "
              f"(0: a line every step); using {DEFAULT_EVERY_S:g}", file=stream, flush=True)
        return DEFAULT_EVERY_S
    return value


def make_progress(total: int, desc: str, enabled: bool = True, stream: TextIO | None = None,
                  env: Mapping[str, str] | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Progress:
    """The bar on a terminal, periodic lines otherwise (a Slurm log, a pipe), or nothing."""
    stream = stream if stream is not None else sys.stderr
    if not enabled:
        return NoProgress()
    if stream.isatty():
        return TqdmProgress(total, desc, stream)
    return LineProgress(total, every_s_from_env(os.environ if env is None else env, stream), stream, clock)
