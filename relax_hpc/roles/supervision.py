"""How the driver watches its Ray roles: every call has a deadline, and a role that dies or
hangs is named at once.

`get_from_roles` waits for calls to named roles (`STATUS_TIMEOUT_S`, `ROLE_START_TIMEOUT_S`,
`CHECKPOINT_TIMEOUT_S`; a training step is polled instead, roles/handles.py). A role that dies
ends the wait with `RoleDiedError`, one that does not answer in time with `RoleTimeoutError`;
both name the role ("trainer rank 1", "rollout", "actor_fwd"), what it was doing, and where its
log is. A failure of a role whose peer died meanwhile (in a collective, say) is reported as
that death, the cause.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Sequence

from relax_hpc.ckpt.errors import NoUsableCheckpointError
from relax_hpc.ckpt.permissions import UnsafeCheckpointError
from relax_hpc.roles.errors import RoleDiedError, RoleTimeoutError

# Deadlines of the driver's calls to Ray roles.
STATUS_TIMEOUT_S = 60.0  # status and control: producer errors, step reports, start and stop
ROLE_START_TIMEOUT_S = 1800.0  # a role's first answer: Ray places it, it loads its model
CHECKPOINT_TIMEOUT_S = 3600.0  # a collective save or load of the weights and optimizer state
# After one trainer rank fails, how long to look for a rank that died: a dead peer makes the
# others fail in their collective too, and the death is the cause to report.
DEATH_GRACE_S = 5.0
# How long one poll waits for a role's error report; a role that does not answer by then is
# asked again at the next poll (with the same call), and the stale check decides if it hangs.
PROBE_WAIT_S = 0.5


def guarded_step(producer_error: Callable[[], str | None], train: Callable[[], Any]) -> Any:
    """Run a train step; if it fails because a producing role failed, say so instead of a queue
    timeout. A role that died is the cause itself."""
    try:
        return train()
    except RoleDiedError:
        raise
    except Exception as e:
        error = producer_error()
        if error:
            raise RuntimeError(error) from e
        raise


def get_from_roles(calls: Sequence[tuple[str, Any]], doing: str, timeout_s: float) -> list[Any]:
    """The results of Ray calls, one per named role (`(name, ObjectRef)`), in order, within `timeout_s`.

    The first role that dies or fails ends the wait at once, whatever the others do (they may
    wait for it in a collective): `RoleDiedError` for a death, the role's own exception (with a
    note naming it) for a failure. `RoleTimeoutError` names the roles that did not answer."""
    import ray

    results: dict[Any, Any] = {}
    pending = [ref for _, ref in calls]
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = " and ".join(name for name, ref in calls if ref in pending)
            raise RoleTimeoutError(f"{late} did not answer within {timeout_s:g} s while {doing} "
                                   f"(hung or overloaded); {_log_hint()}")
        for ref in ready:
            results[ref] = result_of(calls, ref, doing, results)
    return [results[ref] for _, ref in calls]


def result_of(calls: Sequence[tuple[str, Any]], ref: Any, doing: str, results: dict[Any, Any]) -> Any:
    """The result of the finished call `ref`; a dead role or a failure raises (see get_from_roles).
    When the role failed, another role without a result in `results` that died meanwhile (its
    peer in a collective, say) is reported instead."""
    import ray

    who = next(name for name, r in calls if r == ref)
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        raise _died(who, doing, e) from e
    except Exception as failure:
        death = _death_among([(name, r) for name, r in calls if r != ref and r not in results], doing)
        if death is not None:
            raise death from failure
        cause = getattr(failure, "cause", None)  # Ray's RayTaskError carries the role's own exception
        if isinstance(cause, (NoUsableCheckpointError, UnsafeCheckpointError)):
            raise cause from None  # one line that says what to do, not Ray's traceback of it
        failure.add_note(f"(raised by {who} while {doing})")
        raise


def _death_among(calls: Sequence[tuple[str, Any]], doing: str) -> RoleDiedError | None:
    """The death of a role among `calls` that Ray reports within DEATH_GRACE_S, if any."""
    import ray

    if not calls:
        return None
    refs = [ref for _, ref in calls]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DEATH_GRACE_S)
    for name, ref in calls:
        if ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return _died(name, doing, e)
            except Exception:  # noqa: BLE001, S110 - a failure, not a death: the caller raises its own
                pass
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _died(who: str, doing: str, error: BaseException) -> RoleDiedError:
    """`who` died: Ray's reason in one line, with the process id and host its text carries."""
    text = _ANSI.sub("", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(error).__name__]
    pid = re.search(r"\bpid[:=]\s*(\d+)", text)
    host = re.search(r"\bip[:=]\s*([\w.:-]+?)[,)\s]", text + " ")
    where = f" (pid {pid[1]}{f' on {host[1]}' if host else ''})" if pid else ""
    hint = f"{_log_hint(pid[1] if pid else None)}; an out-of-memory kill shows in dmesg on that host"
    if getattr(error, "actor_init_failed", False) or "creation task" in lines[0]:
        return _named(RoleDiedError(f"{who} could not start{where}: {lines[-1]}; {hint}"), who)
    # Ray's text: "The actor died unexpectedly ...", then the reason, then generic advice.
    reason = next((line for line in lines if line.startswith("The actor is dead because")), lines[0])
    reason = reason.split(" Some common causes")[0].rstrip(". ")
    # Ray's ActorUnavailableError: the process may live, but Ray lost it (a network failure).
    verb = "became unreachable" if type(error).__name__ == "ActorUnavailableError" else "died"
    return _named(RoleDiedError(f"{who} {verb} while {doing}{where}: {reason}; {hint}"), who)


def _named(error: RoleDiedError, who: str) -> RoleDiedError:
    error.role = health_name(who)
    return error


def health_name(who: str) -> str:
    """A role's name in health files and events: "trainer rank 1" -> "trainer_rank_1"."""
    return who.replace(" ", "_")


def _log_hint(pid: str | None = None) -> str:
    """Where a role's log is: Ray's worker log on its host, and the job's logs under Slurm."""
    worker = f"worker-*-{pid}.err" if pid else "worker-*.err"
    return (f"check its log: Ray's {worker} in the session's logs directory on its host "
            f"({_ray_logs_dir()} on this one) and, under Slurm, JOBDIR/logs/restart-<n>/")


def _ray_logs_dir() -> str:
    try:  # no public Ray API names the session directory
        from ray._private import worker

        return str(worker._global_node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - only a hint in an error message
        return "<Ray's temp dir, default /tmp/ray>/session_latest/logs"
