"""The agentic part of the rollout configuration, built from `[rollout]` and checked up front."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_hpc.agents.dotted import load_dotted
from relax_hpc.spec.errors import SpecError, SpecProblem
from relax_hpc.spec.schema import JobSpec, RolloutSpec

DOTTED_KEYS = ("env", "generate", "agent")  # [rollout] keys that name code: "package.module:Name"


@dataclass(frozen=True)
class AgenticConfig:
    """Multi-turn / agent settings of the rollout role (docs/spec.md's [rollout] rows)."""

    env: str | None = RolloutSpec.env  # "module:Class", a BaseInteractionEnv
    generate: str | None = RolloutSpec.generate  # "module:function", async def generate(args, sample, params)
    agent: str | None = RolloutSpec.agent  # "module:Class" with async def run(self, data, **kwargs)
    max_turns: int = RolloutSpec.max_turns
    max_total_tokens: int = RolloutSpec.max_total_tokens
    agent_mode: str = RolloutSpec.agent_mode
    turn_discount: float = RolloutSpec.agent_turn_discount
    export_style: str = RolloutSpec.agent_export_style
    subproc_max_workers: int = RolloutSpec.agent_subproc_max_workers
    session_timeout_s: float = RolloutSpec.agent_session_timeout_s

    def check(self) -> None:
        """Raise ValueError listing every problem (keys, values, what is allowed); imports the
        named code so a wrong path fails before any role starts."""
        problems = []
        if self.agent and (self.env or self.generate):
            problems.append("[rollout] agent cannot be combined with env or generate: an agent drives "
                            "the conversation itself through the proxy; set either agent, or env/generate")
        if self.agent_mode not in ("inline", "subproc"):
            problems.append(f'[rollout] agent_mode = "{self.agent_mode}": must be "inline" or "subproc"')
        if self.export_style not in ("individual", "concat"):
            problems.append(f'[rollout] agent_export_style = "{self.export_style}": must be "individual" or "concat"')
        for key, path in (("[rollout] env", self.env), ("[rollout] generate", self.generate),
                          ("[rollout] agent", self.agent)):
            if path:
                try:
                    load_dotted(key, path)
                except ValueError as e:
                    problems.append(str(e))
        if problems:
            raise ValueError("invalid agentic rollout settings:\n  " + "\n  ".join(problems))


def samples_per_session(rollout: Any) -> int:
    """The most training samples one episode or session of a RolloutSpec (or AgenticConfig)
    exports, which the transfer queue is sized by: an env or generate episode is one sample; an
    agent session exports one per completion ("individual") or per chain of completions ("concat":
    a completion that does not extend the chain starts another), at most `max_turns`, which
    `AgenticRollout` holds each session to."""
    return rollout.max_turns if rollout.agent else 1


def agentic_from_spec(rollout: Any) -> AgenticConfig | None:
    """The AgenticConfig of a RolloutSpec, or None for plain single-turn rollouts."""
    if not (rollout.env or rollout.generate or rollout.agent):
        return None
    cfg = AgenticConfig(
        env=rollout.env, generate=rollout.generate, agent=rollout.agent,
        max_turns=rollout.max_turns, max_total_tokens=rollout.max_total_tokens,
        agent_mode=rollout.agent_mode, turn_discount=rollout.agent_turn_discount,
        export_style=rollout.agent_export_style, subproc_max_workers=rollout.agent_subproc_max_workers,
        session_timeout_s=rollout.agent_session_timeout_s,
    )
    cfg.check()
    return cfg


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
