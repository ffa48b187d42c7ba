"""What data may make a reward do: a dataset row names only registered rewards, never a
"module:function" (relax_hpc/rewards/hub.py); the power-tower guard reads `!` after a power as
LaTeX does, treats other digits as symbols and never raises (relax_hpc/rewards/guard.py); reward
worker processes start without the job's credentials (relax_hpc/rewards/workers.py)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from relax_hpc.auth.worker_env import CREDENTIAL_VARS
from relax_hpc.data.sample import Sample
from relax_hpc.rewards import guard
from relax_hpc.rewards.guard import MAX_RESULT_DIGITS, too_large
from relax_hpc.rewards.hub import RewardHub
from relax_hpc.rewards.math_answer import math_equal
from relax_hpc.rewards.workers import RewardWorkers


def _sample(text: str = "", label: str = "7", **metadata: object) -> Sample:
    return Sample([4], [5], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text,
                  finish_reason="stop", metadata=dict(metadata))


MARKER = """
    import sys

    IMPORTED = True


    def pay_all(sample):
        return 1.0
"""


@pytest.mark.parametrize("named", ["builtins:bool", "sys:exit", "data_marker_mod:pay_all"])
def test_a_dataset_row_cannot_name_a_module_function(named: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data_marker_mod.py").write_text(textwrap.dedent(MARKER))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "data_marker_mod", raising=False)
    hub = RewardHub("f1", type_key="rm_type", concurrency=1, timeout_s=5)
    try:
        with pytest.raises(ValueError, match=rf"^metadata rm_type='{named}' is a 'module:function' path, which a "
                                             r"dataset may not name \(only \[reward\] function may\); use one of "
                                             r".*dapo.*, or set \[reward\] function to that path"):
            hub.pick(_sample(rm_type=named))
        samples = [_sample("7", rm_type=named), _sample("7")]  # the second: the default, f1 (inline)
        metrics = hub.score(samples)
        assert [s.reward for s in samples] == [0.0, 1.0]  # refused and counted, not paid 1
        assert metrics["reward/errors"] == 1.0
        assert "data_marker_mod" not in sys.modules  # never imported
    finally:
        hub.close()


def test_data_may_name_registered_rewards_aliases_and_the_specs_own_path() -> None:
    hub = RewardHub("relax_hpc.rewards.f1:f1_reward", type_key="data_source", concurrency=1, timeout_s=5)
    try:
        assert hub.pick(_sample(data_source="math"))[0] == "math"
        assert hub.pick(_sample(data_source="openai/gsm8k"))[0] == "math"  # an alias
        name, fn = hub.pick(_sample(data_source="relax_hpc.rewards.f1:f1_reward"))  # the spec's own
        assert (name, fn) == (hub.default_name, hub.default_fn)
        with pytest.raises(ValueError, match=r"^metadata data_source='nope' names no reward; use one of ") as e:
            hub.pick(_sample(data_source="nope"))
        assert "module:function" not in str(e.value)  # not offered to data any more
    finally:
        hub.close()


@pytest.mark.parametrize(
    "answer",
    [
        "10^{6}!",  # LaTeX reads (10^6)!: 5.6 million digits, not 10^720
        "10^6!",  # (10^6)! in LaTeX, 10**720 in sympy's syntax: the larger one counts
        "10**6!",
        "10^{3}!!",
    ],
)
def test_a_factorial_after_a_power_takes_the_whole_power(answer: str) -> None:
    reason = too_large(answer)
    assert reason is not None and f"(limit {MAX_RESULT_DIGITS})" in reason


@pytest.mark.parametrize("answer", ["2^{10}!", "2^{9}!", "2^{8}!"])  # 1024!: 2,640 digits, not 2^(10!)
def test_small_factorials_of_powers_pass(answer: str) -> None:
    assert too_large(answer) is None


@pytest.mark.parametrize("answer", ["²", "٣^{٣^{٣^{٣}}}", "x²", "2^{²}"])
def test_non_ascii_digits_are_symbols_and_never_raise(answer: str) -> None:
    assert too_large(answer) is None
    assert math_equal(answer, "4") in (True, False)  # the scorer does not raise either


def test_a_guard_that_fails_refuses_the_answer_instead_of_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(token: str) -> float:
        raise ValueError("a bug in the estimate")

    monkeypatch.setattr(guard, "_number_digits", broken)
    assert too_large("12") == "the guard could not read the answer (ValueError): refused before sympy"
    assert math_equal("2^{3}", "8") is False  # refused, not compared (and not raised)


REWARD = """
    import json
    import os
    import subprocess
    import sys

    CHILD = "import json, os; print(json.dumps(sorted(os.environ)))"


    def environment(sample):
        child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
        return {"score": 0.0, "own": sorted(os.environ), "child": json.loads(child.stdout)}
"""


def test_reward_workers_and_what_they_start_get_no_job_credentials(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "env_reward_mod.py").write_text(textwrap.dedent(REWARD))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in CREDENTIAL_VARS:
        monkeypatch.setenv(name, f"/jobs/run-1/.{name.lower()}")
    monkeypatch.setenv("RELAX_TEST_KEEP", "kept")
    import env_reward_mod

    workers = RewardWorkers(processes=1)
    try:
        seen = workers.run(env_reward_mod.environment, _sample(), timeout_s=60)
    finally:
        workers.close()
    for where in ("own", "child"):
        assert not set(CREDENTIAL_VARS) & set(seen[where]), where
        assert "RELAX_TEST_KEEP" in seen[where]
