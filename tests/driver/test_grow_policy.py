"""[federation]: the driver grows its job when rollout is the bottleneck, keeps the grow job only
when steps got faster, and takes the engines back when they are gone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.driver.grow_policy import GrowDriver, GrowPolicy
from relax_hpc.engines.elastic.api import ElasticReply
from relax_hpc.launch.federation import SlurmGrowSubmitter, read_grow_jobs
from relax_hpc.launch.slurm_client import FakeSlurmClient
from relax_hpc.spec import load_spec
from relax_hpc.spec.schema import FederationSpec

REPO = Path(__file__).resolve().parents[2]
SPEC = FederationSpec(max_engines=2, min_step_gain=0.1, window_steps=3)


def step(step_s: float, wait: float, train: float, **engines: float) -> dict[str, float]:
    """One step's metrics: step time, the trainer's wait for rows and its whole time; engines by job."""
    return {"time/step_s": step_s, "time/queue_wait_s": wait, "time/train_s": train,
            **{f"rollout/engines_by_job/{job}": n for job, n in engines.items()}}


def test_a_trainer_that_waits_more_than_it_computes_asks_for_engines() -> None:
    policy = GrowPolicy(SPEC)
    busy = step(1.0, wait=0.3, train=1.0)  # computes 0.7 s, waits 0.3 s: the trainer is the bottleneck
    assert [policy.observe(busy) for _ in range(5)] == [None] * 5
    starved = step(1.0, wait=0.6, train=1.0)  # waits 0.6 s, computes 0.4 s
    decisions = [policy.observe(starved) for _ in range(3)]
    assert decisions[:2] == [None, None]  # the window must fill with starved steps
    grow = decisions[2]
    assert grow is not None and grow.kind == "grow" and grow.engines == 2 and "bottleneck" in grow.reason
    assert policy.phase == "submitting" and policy.baseline_step_s == 1.0


def test_the_grow_job_is_kept_when_steps_got_faster_and_forgotten_when_its_engines_go() -> None:
    policy = GrowPolicy(SPEC, phase="submitting", baseline_step_s=1.0)
    policy.submitted("77")
    assert policy.observe(step(1.0, 0.6, 1.0)) is None and policy.phase == "joining"  # not serving yet
    assert policy.observe(step(0.9, 0.4, 0.9, **{"77": 2})) is None and policy.phase == "measuring"
    assert [policy.observe(step(0.8, 0.3, 0.8, **{"77": 2})) for _ in range(3)] == [None] * 3
    assert policy.phase == "kept"  # 1.0 / 0.8 - 1 = 25% >= 10%
    assert policy.observe(step(0.8, 0.3, 0.8, **{"77": 2})) is None and policy.phase == "kept"
    assert policy.observe(step(1.0, 0.6, 1.0)) is None  # pre-empted: its engines are gone
    assert policy.phase == "watching" and policy.grow_job is None


def test_a_grow_job_that_does_not_pay_is_dropped_and_the_policy_stops() -> None:
    policy = GrowPolicy(SPEC, phase="joining", grow_job="77", baseline_step_s=1.0)
    policy.observe(step(1.0, 0.6, 1.0, **{"77": 2}))
    decisions = [policy.observe(step(0.95, 0.5, 0.95, **{"77": 2})) for _ in range(3)]
    drop = decisions[-1]
    assert drop is not None and drop.kind == "drop" and drop.grow_job == "77"
    assert "only 5% faster" in drop.reason and "min_step_gain = 0.1" in drop.reason
    assert policy.phase == "stopped"
    assert all(policy.observe(step(2.0, 1.5, 2.0)) is None for _ in range(10))  # it grows no more


class FakeSubmitter:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[str, Any]] = []

    def submit(self, engines: int) -> str:
        self.calls.append(("submit", engines))
        if self.fail:
            raise RuntimeError("sbatch: error: invalid partition specified: preempt")
        return "4250"

    def cancel(self, grow_job: str) -> None:
        self.calls.append(("cancel", grow_job))


class FakeRollout:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        self.requests.append((action, body))
        return ElasticReply(202, {"operation": {"id": "op-1"}})


def test_the_driver_submits_then_drains_and_cancels_a_grow_job_that_does_not_pay() -> None:
    submitter, rollout = FakeSubmitter(), FakeRollout()
    grower = GrowDriver(SPEC, submitter, rollout)
    for k in range(3):
        grower.on_step(k + 1, step(1.0, 0.6, 1.0))
    assert submitter.calls == [("submit", 2)] and grower.policy.grow_job == "4250"
    for k in range(4):
        grower.on_step(k + 4, step(1.0, 0.6, 1.0, **{"4250": 2}))
    assert rollout.requests == [("scale_in", {"job": "4250"})]
    assert submitter.calls[-1] == ("cancel", "4250")
    assert "submitted grow job 4250" in grower.events[0] and "gave grow job 4250 back" in grower.events[1]


def test_a_grow_job_that_cannot_be_submitted_does_not_stop_the_run() -> None:
    grower = GrowDriver(SPEC, FakeSubmitter(fail=True), FakeRollout())
    for k in range(3):
        grower.on_step(k + 1, step(1.0, 0.6, 1.0))
    assert grower.policy.phase == "stopped"
    assert "could not grow" in grower.events[0] and "invalid partition" in grower.events[0]


def test_the_slurm_submitter_submits_what_relax_hpc_grow_would(tmp_path: Path) -> None:
    spec = load_spec(REPO / "jobspecs" / "tiny_slurm.toml")
    spec = dataclasses.replace(spec, federation=FederationSpec(max_engines=3, partition="preempt", time="00:20:00"))
    fake = FakeSlurmClient(next_id=4250)
    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o700)
    submitter = SlurmGrowSubmitter(job_dir, "4242", spec, fake)
    assert submitter.submit(3) == "4250"
    (_, script, _), = fake.submitted
    assert "#SBATCH --partition=preempt" in script and "#SBATCH --time=00:20:00" in script
    assert "--engines 3" in script or "--engines=3" in script
    (entry,) = read_grow_jobs(job_dir)
    assert entry["job_id"] == "4250" and entry["engines"] == 3 and entry["preemptible"] is True
    submitter.cancel("4250")
    assert fake.actions == [("cancel", "4250", "", "")]


@pytest.mark.parametrize("toml, problem", [
    ("max_engines = -1", "federation.max_engines"),
    ("min_step_gain = 20.0", "federation.min_step_gain"),
    ('time = "forever"', "federation.time"),
    ("window_steps = 1", "federation.window_steps"),
])
def test_bad_federation_settings_are_named(tmp_path: Path, toml: str, problem: str) -> None:
    from relax_hpc.spec import SpecError

    path = tmp_path / "s.toml"
    path.write_text((REPO / "jobspecs" / "tiny_local.toml").read_text() + f"\n[federation]\n{toml}\n")
    with pytest.raises(SpecError, match=problem.replace(".", r"\.")):
        load_spec(path)
