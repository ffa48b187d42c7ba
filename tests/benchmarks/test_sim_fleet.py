"""benchmarks/sim_fleet.py: a small fleet trains every planned sample once within the staleness
bound, through the in-memory and the ZMQ queue, and the script prints its summary lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
from bench_scripts import benchmark_module

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "sim_fleet.py"
FAST = ["--decode-step-s", "0.0005", "--decode-s-per-token", "0", "--prefill-s-per-token", "0",
        "--call-s", "0", "--load-s", "0", "--max-new-tokens", "16", "--train-step-s", "0.005"]


@pytest.fixture(scope="module")
def sim() -> Iterator[ModuleType]:
    with benchmark_module("sim_fleet") as module:
        yield module


@pytest.mark.parametrize("queue,max_staleness", [("memory", 1), ("zmq", 1), ("memory", 0), ("zmq", 2)])
def test_every_planned_sample_is_trained_once_within_the_staleness_bound(
        sim: ModuleType, queue: str, max_staleness: int) -> None:
    _, cfg = sim.parse_args(["--steps", "5", "--warmup", "1", "--prompts-per-engine", "3", "--samples", "4",
                             "--queue", queue, "--max-staleness", str(max_staleness), *FAST])
    result = sim.run_fleet(cfg, 4)
    assert result.errors == []
    assert result.exactly_once and result.trained == 5 * 4 * 3 * 4
    assert result.produced == result.trained  # nothing generated twice
    assert min(result.staleness) >= 0 and max(result.staleness) <= max_staleness
    assert sum(result.staleness.values()) == result.trained
    assert result.chunks == 5 * 4 * 1  # each step: one chunk per engine (the default)
    assert result.counted == (5 - 1) * 4 * 3 * 4  # samples/s counts the 4 steps after the warm-up


def test_one_engine_takes_each_step_in_one_call(sim: ModuleType) -> None:
    _, cfg = sim.parse_args(["--steps", "3", "--warmup", "1", "--queue", "memory", *FAST])
    result = sim.run_fleet(cfg, 1)
    assert result.exactly_once and result.chunks == 3


def test_the_script_prints_one_summary_line_per_fleet_size() -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--engines", "2", "3", "--steps", "3", "--warmup", "1",
                          "--prompts-per-engine", "2", "--samples", "2", "--queue", "memory", *FAST],
                         check=False, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"fleet 2 engines: \d+\.\d\d of ideal", lines[-2])
    assert re.fullmatch(r"fleet 3 engines: \d+\.\d\d of ideal", lines[-1])
    assert sum("exactly once: yes" in line for line in lines) == 3  # 1, 2 and 3 engines
