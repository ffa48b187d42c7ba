"""Agentic RL: multi-turn environments, tool use, custom generate functions, and agent workflows
behind an OpenAI-compatible proxy. See docs/agents.md.

Import the heavy parts from their modules (`relax_hpc.agents.service`, `.proxy`); this package
itself stays light so that subprocess agent workers start fast.
"""

from relax_hpc.agents.env import BaseInteractionEnv, StepResult

__all__ = ["BaseInteractionEnv", "StepResult"]
