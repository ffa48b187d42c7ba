"""Slurm launch: spec -> hetjob sbatch text (pure), submit/status/cancel through a SlurmClient,
and the helpers the batch script runs inside the allocation (Ray bring-up). docs/slurm.md.
"""
