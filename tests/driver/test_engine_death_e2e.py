"""Two rollout engines as Ray actors; one is SIGKILLed mid-run. The run finishes on the other
engine, every step trains exactly the prompts the data cursor dealt it, each once, and the
engines together produced exactly the samples that were trained (none answered twice)."""

from __future__ import annotations

import collections
import os
import signal
from pathlib import Path

import pytest
from e2e_helpers import ray_roles, tiny_spec_text

from relax_hpc.data.dataset import DataCursor, load_dataset
from relax_hpc.driver.loop import LoopTables, StopFlag, run_loop
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.ops.archive import read_archive
from relax_hpc.ops.metrics import FanOut
from relax_hpc.spec import parse_spec
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, TrainSpec

pytestmark = pytest.mark.slow

STEPS, PROMPTS, N = 6, 16, 16
KILL_AFTER = 2


@pytest.mark.timeout(600)
def test_killing_one_of_two_engines_loses_no_prompt_and_trains_none_twice(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    text = tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=STEPS, save_interval=100,
                          extra="[metrics]\ntrajectory_archive = true\n")
    text = text.replace("max_new_tokens = 4", "max_new_tokens = 4\nnum_engines = 2")
    spec = parse_spec(text)
    with ray_roles(spec) as (roles, job_dir):
        victim = roles.engine_pids()[1]
        seen_engines: list[float] = []

        def on_step(step: int, metrics: dict[str, float]) -> None:
            seen_engines.append(metrics["rollout/engines"])
            if step == KILL_AFTER:  # rollout is generating the next step by now
                os.kill(victim, signal.SIGKILL)

        loop = LoopTables(TrainSpec(steps=STEPS), AlgorithmSpec(max_staleness=0),
                          CheckpointSpec(save_interval=100, resume=False))
        result = run_loop(loop,
                          roles, FanOut([]), StopFlag(), on_step)
        engines = roles.engine_report()

    assert result.end_step == STEPS and result.samples_trained == STEPS * PROMPTS * N
    assert [e["alive"] for e in engines] == [True, False], engines
    # Every sample an engine produced was trained, once: a dead engine's work was redone
    # elsewhere, never counted twice.
    assert sum(e["samples"] for e in engines) == STEPS * PROMPTS * N
    assert engines[1]["samples"] > 0  # it served before it died
    assert seen_engines[:KILL_AFTER] == [2.0] * KILL_AFTER and seen_engines[-1] == 1.0

    # Each step trained exactly the prompts the cursor dealt it, each in one whole group.
    rows, _ = load_dataset(spec.data, load_tokenizer(tiny_model_dir))
    cursor = DataCursor(len(rows), spec.job.seed, spec.data.shuffle)
    archive = read_archive(job_dir)
    assert sorted(archive) == list(range(STEPS))
    groups_seen: set[int] = set()
    for step in range(STEPS):
        trained = archive[step]
        dealt = collections.Counter(rows[i].index for i in cursor.take(PROMPTS))
        per_group = collections.defaultdict(list)
        for row in trained:
            per_group[row.group_id].append(row.prompt_index)
        assert len(trained) == PROMPTS * N
        assert all(len(g) == N and len(set(g)) == 1 for g in per_group.values()), step
        assert collections.Counter(g[0] for g in per_group.values()) == dealt, step
        assert not groups_seen & per_group.keys(), f"step {step} trained a group again"
        groups_seen |= per_group.keys()
