"""relax-hpc: asynchronous, agentic, omni-modal RL post-training for LLMs on Slurm clusters."""

__version__ = "0.1.0"
