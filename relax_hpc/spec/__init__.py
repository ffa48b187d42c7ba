"""The TOML job spec: schema, strict loader, and rendering back to dict / TOML.

    from relax_hpc.spec import load_spec, SpecError
    spec = load_spec("jobspecs/tiny_local.toml")   # SpecError lists every problem at once
    spec.rollout.top_p, spec.job_dir(), spec_to_toml(spec)
    compose_spec(["base.toml", "overlay.toml"], ["train.lr=1e-6"]).spec   # files merged, then --set

docs/spec.md describes every table and key.
"""

from relax_hpc.spec.compose import ComposedSpec, compose_spec
from relax_hpc.spec.errors import SpecError, SpecProblem
from relax_hpc.spec.loader import load_spec, parse_spec
from relax_hpc.spec.render import redact_secrets, spec_to_dict, spec_to_toml
from relax_hpc.spec.schema import (
    ALGORITHMS,
    GROUP_NORMALISED_ALGORITHMS,
    AlgorithmName,
    AlgorithmSpec,
    CheckpointSpec,
    ClusterSpec,
    ComponentSpec,
    ContainerSpec,
    DataSpec,
    FederationSpec,
    HealthSpec,
    JobInfoSpec,
    JobSpec,
    MetricsSpec,
    ModelSpec,
    NotifySpec,
    RewardSpec,
    RolloutSpec,
    SecuritySpec,
    TrainSpec,
)
from relax_hpc.spec.slurm_values import slurm_time_to_seconds

__all__ = [
    "ALGORITHMS",
    "GROUP_NORMALISED_ALGORITHMS",
    "AlgorithmName",
    "AlgorithmSpec",
    "CheckpointSpec",
    "ClusterSpec",
    "ComponentSpec",
    "ComposedSpec",
    "ContainerSpec",
    "DataSpec",
    "JobInfoSpec",
    "JobSpec",
    "MetricsSpec",
    "ModelSpec",
    "FederationSpec",
    "HealthSpec",
    "NotifySpec",
    "RewardSpec",
    "RolloutSpec",
    "SecuritySpec",
    "SpecError",
    "SpecProblem",
    "TrainSpec",
    "compose_spec",
    "load_spec",
    "parse_spec",
    "redact_secrets",
    "slurm_time_to_seconds",
    "spec_to_dict",
    "spec_to_toml",
]
