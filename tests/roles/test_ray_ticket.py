"""A trainer step on Ray ends at once when a producing role fails, not after the queue timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray

from relax_hpc.roles.handles import _RayTicket


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    yield
    ray.shutdown()


@ray.remote
def rank_step(seconds: float, rows: float) -> dict[str, float]:
    time.sleep(seconds)
    return {"rows": rows, "reward_sum": rows / 2, "loss": 0.25}


@pytest.mark.slow
def test_a_failed_producer_ends_the_wait_with_its_error(ray_cluster: None) -> None:
    polls: list[float] = []

    def errors() -> str | None:
        polls.append(time.monotonic())
        return "rollout producer failed: ValueError: bad prompt" if len(polls) >= 2 else None

    ticket = _RayTicket([rank_step.remote(120.0, 4.0)], errors, poll_s=0.2)
    with pytest.raises(RuntimeError, match=r"rollout producer failed: ValueError: bad prompt \(the trainer was waiting"):
        ticket.result()
    assert len(polls) == 2 and not ticket.done  # the second poll saw the error; nothing waited 120 s


@pytest.mark.slow
def test_ranks_that_finish_give_merged_stats(ray_cluster: None) -> None:
    ticket = _RayTicket([rank_step.remote(0.3, 4.0), rank_step.remote(0.1, 6.0)], lambda: None, poll_s=0.05)
    stats = ticket.result()
    assert ticket.done and stats["rows"] == 10.0 and stats["reward_sum"] == 5.0 and stats["loss"] == 0.25
