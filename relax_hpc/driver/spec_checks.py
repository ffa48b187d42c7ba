"""The checks of a spec that need more than the spec itself, made alike by `validate`,
`submit` and `run`: what the trainer would refuse of the model (backends/spec_checks.py), the
model's sizes against the layout and the GPUs' memory (spec/model_fit.py), the media the model,
engine and backend cannot take (media/plan.py), the [notify] URLs (driver/alerts.py) and the
code `[rollout] env`, `generate` and `agent` name (agents/config.py). Each raises SpecError (or
ValueError for a URL) naming every problem; none imports torch or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_hpc.agents.config import check_agent_code
from relax_hpc.backends.spec_checks import check_backend_support
from relax_hpc.driver.alerts import check_notify
from relax_hpc.media.plan import MediaPlan, check_media_plan
from relax_hpc.spec.model_fit import ModelShape, check_model_fit
from relax_hpc.spec.schema import JobSpec


@dataclass(frozen=True)
class SpecChecked:
    """What the checks found out: the model's shape (None: its config.json is not readable
    here, so the checks that need it wait for `run`) and the media plan."""

    shape: ModelShape | None
    media: MediaPlan


def check_spec_runs(spec: JobSpec, source: str) -> SpecChecked:
    """Every check beyond the spec's own, in the order a user fixes them."""
    check_backend_support(spec, source)  # what the trainer would refuse of the model at start
    shape = check_model_fit(spec, source)  # the model's sizes against the parallel layout, where readable
    media = check_media_plan(spec, source)  # media the model, backend and engine cannot take
    check_notify(spec)  # [notify] URLs Apprise refuses, a urls_file others can read
    check_agent_code(spec, source)  # a [rollout] env / generate / agent path that does not import
    return SpecChecked(shape, media)
