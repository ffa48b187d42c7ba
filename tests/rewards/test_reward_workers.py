"""Killable reward scoring: plain rewards in worker processes that a timeout kills and replaces.

The rewards below live in a module written to tmp_path (on sys.path), so they pickle by
reference and reach the workers, as a user's "my_pkg.rewards:fn" does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.hub import RewardHub
from relax_hpc.rewards.pool import RewardPool
from relax_hpc.rewards.registry import failure_score, resolve_reward
from relax_hpc.rewards.workers import RewardWorkerDied, RewardWorkers, can_run_in_worker

REWARDS = """
    import os

    import math_verify

    from relax_hpc.rewards.registry import scores_failure_as


    def length(sample):
        return float(len(sample.response_text))


    def pid(sample):
        return {"score": 1.0, "pid": os.getpid()}


    def gil_hog(sample):
        # A big-integer power holds the interpreter lock for minutes: no thread can stop it.
        return float(9 ** (9 ** 9) % 7)


    def sympy_tower(sample):
        # The unguarded hang a policy found: comparing the tower makes sympy evaluate it.
        gold = math_verify.parse("\\\\boxed{" + str(sample.label) + "}", parsing_timeout=None)
        pred = math_verify.parse("\\\\boxed{" + sample.response_text + "}", parsing_timeout=None)
        return float(math_verify.verify(gold, pred, timeout_seconds=None))


    def dies(sample):
        os._exit(3)


    def raises(sample):
        raise ValueError("bad row")


    def hog_memory(sample):
        return float(len(bytearray(2 * 2**30)))


    @scores_failure_as(-1.0)
    def signed_hog(sample):
        if sample.response_text == "hang":
            return float(9 ** (9 ** 9) % 7)
        return 1.0 if sample.response_text == sample.label else -1.0
"""


@pytest.fixture
def rewards_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "worker_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "worker_rewards", raising=False)
    return "worker_rewards"


def _sample(text: str = "", label: object = None) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text)


def test_a_timeout_kills_the_worker_and_a_new_one_takes_the_next_sample(rewards_module: str) -> None:
    hog, pid = resolve_reward(f"{rewards_module}:gil_hog"), resolve_reward(f"{rewards_module}:pid")
    workers = RewardWorkers(processes=1)
    try:
        first = workers.run(pid, _sample(), timeout_s=30)["pid"]  # type: ignore[index]
        with pytest.raises(TimeoutError):
            workers.run(hog, _sample(), timeout_s=1)
        second = workers.run(pid, _sample(), timeout_s=30)["pid"]  # type: ignore[index]
    finally:
        workers.close()
    assert workers.replaced == 1
    assert first != second  # the hung worker was killed; the next sample ran in a new one
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)


SLOW_START = """
    import time

    time.sleep(3)  # as an interpreter that starts slowly on a busy node
"""


def test_a_workers_start_up_and_the_rewards_import_are_not_the_rewards_time(
        rewards_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # sitecustomize runs at every interpreter start: each worker takes 3 s to come up, and the
    # rewards module's import (math_verify, sympy) comes on top. A 2 s timeout is for scoring.
    site = tmp_path / "slow_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SLOW_START))
    monkeypatch.syspath_prepend(str(site))
    length = resolve_reward(f"{rewards_module}:length")
    workers = RewardWorkers(processes=1)
    try:
        assert workers.run(length, _sample("abc"), timeout_s=2) == 3.0
    finally:
        workers.close()
    assert workers.replaced == 0


def test_a_worker_that_never_comes_up_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "slow_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SLOW_START))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr("relax_hpc.rewards.workers.START_TIMEOUT_S", 0.5)
    workers = RewardWorkers(processes=1)
    try:
        with pytest.raises(RewardWorkerDied, match=r"did not say it was ready within 0.5 s"):
            workers.run(resolve_reward("tiny_sum"), _sample(), timeout_s=30)
    finally:
        workers.close()


def test_a_worker_that_dies_is_replaced(rewards_module: str) -> None:
    dies, length = resolve_reward(f"{rewards_module}:dies"), resolve_reward(f"{rewards_module}:length")
    workers = RewardWorkers(processes=1)
    try:
        with pytest.raises(RewardWorkerDied, match=r"died while scoring \(exit code 3\)"):
            workers.run(dies, _sample(), timeout_s=30)
        assert workers.run(length, _sample("abcd"), timeout_s=30) == 4.0
    finally:
        workers.close()
    assert workers.replaced == 1


def test_a_reward_error_keeps_the_worker(rewards_module: str) -> None:
    raises, pid = resolve_reward(f"{rewards_module}:raises"), resolve_reward(f"{rewards_module}:pid")
    workers = RewardWorkers(processes=1)
    try:
        before = workers.run(pid, _sample(), timeout_s=30)["pid"]  # type: ignore[index]
        with pytest.raises(RuntimeError, match="ValueError: bad row"):
            workers.run(raises, _sample(), timeout_s=30)
        with pytest.raises(Exception):  # a sample that cannot be sent fails before the worker sees it
            workers.run(pid, _sample(label=lambda: None), timeout_s=30)
        after = workers.run(pid, _sample(), timeout_s=30)["pid"]  # type: ignore[index]
    finally:
        workers.close()
    assert before == after and workers.replaced == 0


def test_memory_cap_turns_a_runaway_allocation_into_an_error(rewards_module: str) -> None:
    hog = resolve_reward(f"{rewards_module}:hog_memory")
    workers = RewardWorkers(processes=1, memory_mb=1024)
    try:
        with pytest.raises(RuntimeError, match="MemoryError"):
            workers.run(hog, _sample(), timeout_s=60)
    finally:
        workers.close()


def test_pool_scores_a_timeout_as_a_wrong_answer_and_goes_on(rewards_module: str) -> None:
    signed = resolve_reward(f"{rewards_module}:signed_hog")
    assert failure_score(signed) == -1.0
    samples = [_sample("hang", "7"), _sample("7", "7"), _sample("3", "7")]
    # 6 s of scoring: a worker's start-up and the module's import do not count (the test above).
    with RewardPool(concurrency=3, timeout_s=6, worker_processes=2) as pool:
        stats = pool.score(samples, lambda s: ("signed", signed))
        again = [_sample("7", "7")]
        pool.score(again, lambda s: ("signed", signed))
    # A timeout never pays more than a wrong answer.
    assert [s.reward for s in samples] == [-1.0, 1.0, -1.0]
    assert samples[0].reward_info == {"reward_timeout": 1.0}
    assert stats.as_metrics()["reward/timeouts"] == 1.0 and stats.errors == 0
    assert again[0].reward == 1.0


def test_errors_score_the_rewards_failure_score() -> None:
    # dapo pays -1 for a wrong answer, so an error is -1 too; math pays 0.
    assert failure_score(resolve_reward("dapo")) == -1.0
    assert failure_score(resolve_reward("math")) == 0.0
    hub = RewardHub("dapo", type_key="rm_type", timeout_s=10)
    try:
        samples = [_sample("Answer: 2", "2"), _sample("x", "2", ), _sample("Answer: 2", object())]
        samples[1].metadata["rm_type"] = "no_such_reward"
        metrics = hub.score(samples)
    finally:
        hub.close()
    assert samples[0].reward == 1.0
    assert samples[1].reward_info == {"reward_error": 1.0}  # no reward chosen: 0, counted
    assert metrics["reward/errors"] == 1.0


def test_closures_cannot_reach_a_worker_and_run_on_threads() -> None:
    def closure(sample: Sample) -> float:
        return 2.0

    assert not can_run_in_worker(closure)
    assert can_run_in_worker(resolve_reward("math"))
    samples = [_sample("a")]
    with RewardPool(concurrency=2, timeout_s=5, worker_processes=1) as pool:
        pool.score(samples, lambda s: ("closure", closure))
        assert pool.workers is not None and pool.workers._running == 0  # no worker was started
    assert samples[0].reward == 2.0


def test_worker_processes_zero_runs_plain_rewards_on_threads(rewards_module: str) -> None:
    pid = resolve_reward(f"{rewards_module}:pid")
    samples = [_sample()]
    with RewardPool(concurrency=2, timeout_s=5, worker_processes=0) as pool:
        assert pool.workers is None
        pool.score(samples, lambda s: ("pid", pid))
    assert samples[0].reward_info["pid"] == os.getpid()


HANG_SCRIPT = """
import json, sys, time
sys.path.insert(0, {module_dir!r})
from relax_hpc.data.sample import Sample
from relax_hpc.rewards.hub import RewardHub

def sample(text, label):
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text)

out = {{}}
towers = ["9^{{9^{{9}}}}", "2^{{2^{{2^{{2^{{2^{{10}}}}}}}}}}", "10^{{10^{{10^{{10}}}}}}"]
# dapo, guarded: the towers in the answer and in the label.
hub = RewardHub("dapo", timeout_s=3, concurrency=4)
step1 = [sample("Answer: " + t, "3") for t in towers] + [sample("Answer: 3", towers[2])]
start = time.monotonic()
out["step1"] = hub.score(step1)
out["step1_s"] = time.monotonic() - start
out["step1_rewards"] = [s.reward for s in step1]
step2 = [sample("Answer: 7", "7"), sample("Answer: 8", "7")]
out["step2"] = hub.score(step2)
out["step2_rewards"] = [s.reward for s in step2]
hub.close()
# The same towers straight into sympy (no guard): only killing the worker stops them.
hub = RewardHub("worker_rewards:sympy_tower", timeout_s=3, concurrency=4)
step3 = [sample(t, "3") for t in towers]
start = time.monotonic()
out["step3"] = hub.score(step3)
out["step3_s"] = time.monotonic() - start
out["replaced"] = hub.pool.workers.replaced
step4 = [sample("7", "7")]
out["step4"] = hub.score(step4)
out["step4_rewards"] = [s.reward for s in step4]
hub.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_power_towers_cannot_hang_a_run(tmp_path: Path) -> None:
    (tmp_path / "worker_rewards.py").write_text(textwrap.dedent(REWARDS))
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT.format(module_dir=str(tmp_path)))
    # The subprocess's own hard kill is the guard: a hang fails the test instead of stalling it.
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # dapo refuses the towers before sympy: wrong answers (-1), not timeouts, not errors.
    assert out["step1_rewards"] == [-1.0, -1.0, -1.0, -1.0]
    assert out["step1"]["reward/timeouts"] == 0.0 and out["step1"]["reward/errors"] == 0.0
    assert out["step2_rewards"] == [1.0, -1.0]  # the next step is scored as usual
    # Unguarded, each tower hangs sympy: its worker is killed at timeout_s and counted.
    assert out["step3"]["reward/timeouts"] == 3.0 and out["replaced"] == 3
    assert out["step4_rewards"] == [1.0]
    print(f"guarded step {out['step1_s']:.1f} s, unguarded step {out['step3_s']:.1f} s (timeout_s = 3)")
