"""Agentic RL: multi-turn environments, tool use, custom generate functions, and agent workflows
behind an OpenAI-compatible proxy. See docs/agents.md.

Import the heavy parts from their modules (`relax_hpc.agents.service`, `.proxy`); this package
itself stays light so that subprocess agent workers start fast, and so that `relax-hpc validate`
can check the code a spec names without torch: `BaseInteractionEnv` and `StepResult` (which
bring torch with `Sample`) are loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BaseInteractionEnv", "StepResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from relax_hpc.agents import env

        return getattr(env, name)
    raise AttributeError(f"module 'relax_hpc.agents' has no attribute {name!r}")
