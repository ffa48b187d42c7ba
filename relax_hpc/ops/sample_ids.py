"""Sample ids: a sample's slot in its step, (step, group position, member), in one int64.

They travel as a queue scalar and an archive column; `relax-hpc inspect JOBDIR
--check-exactly-once` checks that every slot was trained exactly once (docs/archive.md).
Here, below the data layer, because the archive reads and writes them.
"""

from __future__ import annotations

# sample_id = (step * GROUPS + group) * MEMBERS + member: decimal digit fields, so 12000003000005
# reads as step 12, group 3, member 5. int64 bounds the step to 9_223_371 ([train] steps allows 10**7).
SAMPLE_ID_GROUPS = 10**6  # group positions per step: [rollout] prompts_per_step is at most 10**6
SAMPLE_ID_MEMBERS = 10**6  # samples per group: n_samples_per_prompt, or what an agent's sessions export
SAMPLE_ID_MAX_STEP = (2**63 - 1) // (SAMPLE_ID_GROUPS * SAMPLE_ID_MEMBERS) - 1
NO_SAMPLE_ID = -1  # not assigned (a sample built outside a rollout step, or an older archive)


def make_sample_id(step: int, group: int, member: int) -> int:
    """The id of member `member` of the step's group number `group` (both counted from 0)."""
    if not (0 <= step <= SAMPLE_ID_MAX_STEP and 0 <= group < SAMPLE_ID_GROUPS and 0 <= member < SAMPLE_ID_MEMBERS):
        raise ValueError(f"sample id of step {step}, group {group}, member {member}: out of range (step "
                         f"0..{SAMPLE_ID_MAX_STEP}, group 0..{SAMPLE_ID_GROUPS - 1}, member "
                         f"0..{SAMPLE_ID_MEMBERS - 1})")
    return (step * SAMPLE_ID_GROUPS + group) * SAMPLE_ID_MEMBERS + member


def split_sample_id(sample_id: int) -> tuple[int, int, int]:
    """(step, group, member) of an id made by make_sample_id."""
    if sample_id < 0:
        raise ValueError(f"sample id {sample_id} is not assigned")
    rest, member = divmod(sample_id, SAMPLE_ID_MEMBERS)
    step, group = divmod(rest, SAMPLE_ID_GROUPS)
    return step, group, member


def format_sample_id(sample_id: int) -> str:
    """'s12-g3-m5' for step 12, group 3, member 5; 'unassigned' for NO_SAMPLE_ID."""
    if sample_id < 0:
        return "unassigned"
    step, group, member = split_sample_id(sample_id)
    return f"s{step}-g{group}-m{member}"
