"""How the suite is split between pytest-xdist workers (`--dist loadgroup`; docs/testing.md,
"Two workers"), for tests/conftest.py, in a module of its own so that tests can import it (a
test's `import conftest` may find another directory's conftest)."""

from __future__ import annotations

from typing import Any

# Tests that share one session start-up run in one worker: the local Slurm (tests/slurm) and the
# venv with the relax-hpc wheel (`wheel_venv`, used by tests/slurm and tests/cli/test_wheel_install).
SHARED_GROUPS = {"tests/slurm/": "slurm", "tests/cli/test_wheel_install.py": "slurm"}


def xdist_group_of(nodeid: str) -> str:
    """The worker group of a test: its shared start-up's group, else its module, so a module's
    fixtures (a Ray cluster, SGLang servers, one run read by several tests) start once."""
    path = nodeid.split("::", 1)[0]
    for prefix, group in SHARED_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


# The groups that take longest (docs/testing.md, measured), handed out first so that two workers
# end together instead of one waiting on a long group handed out last. Those that need .venv-sglang
# or .venv-megatron come after a few that need neither: under tools/test-all those environments
# are still being built when the tests start.
LONGEST_FIRST = ("slurm", "tests/driver/test_omni_e2e.py", "tests/driver/test_train_e2e.py",
                 "tests/backends/test_megatron_backend.py",
                 "tests/driver/test_sglang_e2e.py", "tests/engines/test_sglang_fleet.py",
                 "tests/launch/test_faults_rerun.py", "tests/launch/test_faults_global.py",
                 "tests/launch/test_faults_three_kills.py", "tests/launch/test_faults_in_place.py",
                 "tests/driver/test_algorithms_e2e.py", "tests/engines/test_sglang_media.py",
                 "tests/rewards/test_reward_workers.py", "tests/launch/test_faults_disk_full.py",
                 "tests/launch/test_rehearse_e2e.py", "tests/backends/test_megatron_critic.py",
                 "tests/backends/test_fsdp2_multimodal.py", "tests/backends/test_sharded_load.py",
                 "tests/agents/test_tool_specs_learn.py")


# Groups that mostly wait (ZMQ and HTTP timeouts, gloo rendezvous, nested pytest sessions): on
# 2026-12-01 the machine was 10-50% busy while one of them ran beside another, and on 2026-12-08
# 37% idle while they ran beside the Slurm group (which waits on its jobs' start-ups and requeues
# too). They go out one after each of the longest groups that are handed out once the Slurm
# group's worker is about to be free (WAITING_AFTER: the Slurm group, then about 600 s of the
# other worker's longest groups), so each is likely to run beside a group that keeps both cores
# busy, and never two of them back to back while long groups remain.
MOSTLY_WAITING = ("tests/transfer/test_transfer_queue_contract.py", "tests/transfer/test_transfer_auth.py",
                  "tests/transfer/test_transfer_zmq.py", "tests/transfer/test_transfer_shm.py",
                  "tests/transfer/test_transfer_limits.py", "tests/weights/test_store_auth.py",
                  "tests/weights/test_weights_gloo.py", "tests/test_time_budget.py",
                  "tests/engines/test_remote_engine.py", "tests/engines/test_http_auth.py",
                  "tests/engines/test_http_server_limits.py", "tests/engines/test_elastic.py",
                  "tests/driver/test_restarts.py", "tests/agents/test_proxy.py")
WAITING_AFTER = 6  # how many of LONGEST_FIRST go out before the first of MOSTLY_WAITING


def hand_out_order() -> tuple[str, ...]:
    """The first WAITING_AFTER of LONGEST_FIRST, then the rest of LONGEST_FIRST with one of
    MOSTLY_WAITING after each (those left over after the last of the longest, one by one)."""
    order: list[str] = list(LONGEST_FIRST[:WAITING_AFTER])
    rest = LONGEST_FIRST[WAITING_AFTER:]
    for k in range(max(len(rest), len(MOSTLY_WAITING))):
        order += [*rest[k:k + 1], *MOSTLY_WAITING[k:k + 1]]
    return tuple(order)


HAND_OUT_ORDER = hand_out_order()


def hand_out_rank(group: str) -> int:
    """Where a group comes in the order the workers take them (`hand_out_order`), then every
    other group (in file order: the sort that uses this is stable)."""
    return HAND_OUT_ORDER.index(group) if group in HAND_OUT_ORDER else len(HAND_OUT_ORDER)


def keep_group_order(config: Any) -> None:
    """xdist's default re-sorts the groups by their number of tests, most first, which put the
    longest groups (one to five tests each) last: one worker ran them alone at the end of the run.
    The order tests/conftest.py gives the items (LONGEST_FIRST) is the one wanted."""
    config.option.loadscopereorder = False
