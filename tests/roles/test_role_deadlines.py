"""Every driver call to a Ray role has a deadline; a role that dies or hangs is named at once.

`get_from_roles` is what `RayRoles` waits with; `_RayTicket` polls a training step's ranks.
The Ray tests use real actors: a hung call sleeps past a tiny deadline, a dead rank is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import ray

from relax_hpc.roles.handles import RoleDiedError, RoleTimeoutError, _RayTicket
from relax_hpc.roles.supervision import _died, get_from_roles
from role_fakes import BrokenRole, FakeRole


def test_a_death_message_names_the_role_its_process_and_its_log() -> None:
    # Ray's text for a SIGKILLed actor, shortened: the reason line, then generic advice.
    error = ray.exceptions.RayActorError(error_msg=(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: ActorWorker\n"
        "\tpid: 4242\n\tip: 10.1.2.3\nThe actor is dead because its worker process has died. "
        "Worker exit type: SYSTEM_ERROR Some common causes include: (1) the OOM killer"))
    message = str(_died("trainer rank 1", "training step 3", error))
    assert message.startswith("trainer rank 1 died while training step 3 (pid 4242 on 10.1.2.3): "
                              "The actor is dead because its worker process has died. "
                              "Worker exit type: SYSTEM_ERROR; check its log: Ray's worker-*-4242.err")
    assert "JOBDIR/logs/restart-<n>/" in message and "dmesg" in message
    assert "common causes" not in message


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    # The actors are classes of tests/roles/role_fakes.py, which imports neither torch nor this
    # package: each actor process imports only it (this module would bring torch, seconds each).
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": here}})
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_call_past_its_deadline_names_the_role_and_what_it_was_doing(ray_cluster: None) -> None:
    hung = FakeRole.remote()
    with pytest.raises(RoleTimeoutError, match=r"^rollout did not answer within 0.5 s while reporting step 2 "
                                               r"\(hung or overloaded\); check its log: Ray's worker-\*.err"):
        get_from_roles([("rollout", hung.sleep.remote(60.0))], "reporting step 2", 0.5)
    ray.kill(hung)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_answers_come_back_in_order(ray_cluster: None) -> None:
    roles = [FakeRole.remote(), FakeRole.remote()]
    # Both started before the deadline's clock runs: on a loaded 2-core machine starting two actor
    # processes took more than the 30 s the calls are given (seen beside an environment build).
    ray.get([role.pid.remote() for role in roles])
    calls = [("trainer rank 0", roles[0].sleep.remote(0.3)), ("trainer rank 1", roles[1].sleep.remote(0.1))]
    assert get_from_roles(calls, "saving", 30.0) == [0.3, 0.1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_dead_rank_ends_the_wait_while_the_other_still_runs(ray_cluster: None) -> None:
    ranks = [FakeRole.remote(), FakeRole.remote()]
    victim = ray.get(ranks[1].pid.remote())
    calls = [("trainer rank 0", ranks[0].sleep.remote(600.0)), ("trainer rank 1", ranks[1].sleep.remote(600.0))]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RoleDiedError, match=rf"^trainer rank 1 died while saving the checkpoint of step 4 "
                                            rf"\(pid {victim} on [^)]+\): The actor is dead because"):
        get_from_roles(calls, "saving the checkpoint of step 4", 600.0)
    ray.kill(ranks[0])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_role_that_cannot_start_is_named_with_its_error(ray_cluster: None) -> None:
    broken = BrokenRole.remote()
    with pytest.raises(RoleDiedError, match=r"^actor_fwd could not start \(pid \d+.*\): "
                                            r"OSError: no such model: /models/missing; check its log"):
        get_from_roles([("actor_fwd", broken.pid.remote())], "starting", 60.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_training_step_names_a_dead_rank_not_the_collective_error_it_caused(ray_cluster: None) -> None:
    ranks = [FakeRole.remote(), FakeRole.remote()]
    victim = ray.get(ranks[1].pid.remote())
    # Rank 0 fails as soon as rank 1 is gone, possibly before Ray reports rank 1 dead: the
    # death is still what the step reports.
    refs = [ranks[0].fail_when_gone.remote(victim), ranks[1].sleep.remote(600.0)]
    ticket = _RayTicket(refs, lambda: None, poll_s=0.2, doing="training step 7")
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RoleDiedError, match=r"^trainer rank 1 died while training step 7") as caught:
        ticket.result()
    assert not ticket.done
    assert caught.value.__cause__ is not None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_rank_ends_the_step_with_its_own_error_named(ray_cluster: None) -> None:
    ranks = [FakeRole.remote(), FakeRole.remote()]
    ticket = _RayTicket([ranks[0].sleep.remote(600.0), ranks[1].fail.remote()], lambda: None, poll_s=0.2,
                        doing="training step 2")
    with pytest.raises(ValueError, match="bad rows") as caught:
        ticket.result()  # not after rank 0's 600 s
    assert "(raised by trainer rank 1 while training step 2)" in caught.value.__notes__
    ray.kill(ranks[0])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_checkpoint_refusal_reaches_the_driver_as_itself_not_wrapped(ray_cluster: None) -> None:
    # The CLI prints a ValueError on one line: Ray's wrapper would print the role's traceback too.
    from relax_hpc.ckpt.errors import NoUsableCheckpointError

    role = FakeRole.remote()
    with pytest.raises(NoUsableCheckpointError) as raised:
        get_from_roles([("trainer rank 0", role.fail_to_resume.remote())], "loading the newest checkpoint", 60)
    assert type(raised.value) is NoUsableCheckpointError
    assert str(raised.value).splitlines() == ["no checkpoint of /j/checkpoints loads (step_3: resume.json is "
                                              "missing); fix it, or relax-hpc run --start-over"]
    ray.kill(role)

