"""The agentic part of `[rollout]` (env, generate, agent and their keys): whether a run is agentic,
how many samples a session exports, and the check that the code the keys name imports. The
values themselves are checked with the rest of the spec (spec/cross_checks.py); the rollout role's
`AgenticRollout` reads them from the RolloutSpec itself."""

from __future__ import annotations

from relax_hpc.agents.dotted import load_dotted
from relax_hpc.spec.errors import SpecError, SpecProblem
from relax_hpc.spec.schema import JobSpec, RolloutSpec

DOTTED_KEYS = ("env", "generate", "agent")  # [rollout] keys that name code: "package.module:Name"


def is_agentic(rollout: RolloutSpec) -> bool:
    """Whether `[rollout]` names an env, a custom generate or an agent: the rollout role then
    generates through `AgenticRollout` instead of its single-turn path."""
    return bool(rollout.env or rollout.generate or rollout.agent)


def samples_per_session(rollout: RolloutSpec) -> int:
    """The most training samples one episode or session of `[rollout]` exports, which the
    transfer queue is sized by: an env or generate episode is one sample; an agent session
    exports one per completion ("individual") or per chain of completions ("concat": a
    completion that does not extend the chain starts another), at most `max_turns`, which
    `AgenticRollout` holds each session to."""
    return rollout.max_turns if rollout.agent else 1


def agent_code_problems(rollout: RolloutSpec) -> list[SpecProblem]:
    """The code `[rollout] env`, `generate` and `agent` name, imported here: a path that does
    not resolve is a problem of the spec, reported by validate and submit as by run."""
    problems = []
    for key in DOTTED_KEYS:
        path = getattr(rollout, key)
        if path:
            try:
                load_dotted(f"[rollout] {key}", path)
            except ValueError as e:
                problems.append(SpecProblem(key=f"rollout.{key}", value=repr(path), message=str(e).split(": ", 1)[-1]))
    return problems


def check_agent_code(spec: JobSpec, source: str) -> None:
    """SpecError naming every `[rollout]` code path that cannot be imported."""
    problems = agent_code_problems(spec.rollout)
    if problems:
        raise SpecError(problems, source)
