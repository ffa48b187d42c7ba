"""Two trainer ranks as Ray actors over gloo; rank 1 is SIGKILLed while the driver waits on a
step. The loop fails at once with an error that names trainer rank 1, instead of waiting for
rank 0's collective or the queue to time out (both are set far longer than this test may run)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from e2e_helpers import ray_roles, tiny_spec_text

from relax_hpc.driver.loop import LoopTables, StopFlag, run_loop
from relax_hpc.ops.metrics import FanOut
from relax_hpc.roles.handles import RoleDiedError
from relax_hpc.spec import parse_spec
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, TrainSpec

pytestmark = pytest.mark.slow

STEPS = 6
KILL_AFTER = 1


@pytest.mark.timeout(300)
def test_killing_a_trainer_rank_mid_step_fails_the_loop_naming_that_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    text = tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=STEPS, save_interval=100)
    spec = parse_spec(text.replace("micro_batch_size = 256", "micro_batch_size = 64\nnum_processes = 2"))
    # The queue timeout (and gloo's collective timeout, 30 min) are far past the test's.
    with ray_roles(spec, num_processes=2, timeout_s=3600.0) as (roles, _):
        victim = roles.trainer_pids()[1]
        finished: list[int] = []

        def on_step(step: int, metrics: dict[str, float]) -> None:
            finished.append(step)
            if step == KILL_AFTER:  # step 1 is submitted: both ranks wait for its rows or train it
                os.kill(victim, signal.SIGKILL)

        with pytest.raises(RoleDiedError) as caught:
            run_loop(LoopTables(TrainSpec(steps=STEPS), AlgorithmSpec(max_staleness=0),
                                CheckpointSpec(save_interval=100, resume=False)),
                     roles, FanOut([]), StopFlag(), on_step)

    # The step that fails is the one after the last finished: step 1, unless both ranks were
    # through it before the kill landed (then step 2).
    assert finished[0] == KILL_AFTER and len(finished) <= 2
    message = str(caught.value)
    assert message.startswith(f"trainer rank 1 died while training step {finished[-1]} (pid {victim}"), message
    assert f"worker-*-{victim}.err" in message and "JOBDIR/logs/restart-<n>/" in message
