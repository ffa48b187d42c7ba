"""The reward function of environment and agent rollouts: `[reward] function =
"relax_hpc.agents.rewards:env_reward"` trains on what the environment (sum of its per-turn
rewards) or the agent's run() (after turn discount) gave the sample."""

from __future__ import annotations

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.registry import inline_reward


@inline_reward  # a dictionary look-up: not worth a trip to a reward worker process
def env_reward(sample: Sample) -> float:
    if "env_reward" not in sample.metadata:
        raise ValueError(
            "env_reward: the sample has no metadata['env_reward']; this reward only works with "
            "[rollout] env, agent, or a generate function that sets it"
        )
    return float(sample.metadata["env_reward"])
