"""Turn a JobSpec back into plain data: a dict (for JSON, logs) or TOML (the resolved spec).

The job directory keeps ``spec.resolved.toml`` written from here, so a run can always be
repeated with exactly the values it used, defaults included, even after defaults change.

Secrets are redacted unless asked for: the alert URLs of ``[notify] urls`` appear as
``slack://***/***``, the values of ``[container] env`` as ``HF_TOKEN=***`` and a tracking
server's password as ``https://user:***@host``
(relax_hpc/spec/secret_urls.py) in ``relax-hpc show``, in the job directory's spec.toml, in the
W&B run's config and in anything logged. Only the spec a Slurm job reads back
(``spec.submit.toml``, owner-only) is written with ``redact=False``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tomli_w

from relax_hpc.spec.schema import JobSpec
from relax_hpc.spec.secret_urls import redact_env, redact_url, redact_userinfo

__all__ = ["redact_secrets", "spec_to_dict", "spec_to_toml"]


def redact_secrets(spec: JobSpec) -> JobSpec:
    """``spec`` with every secret shown redacted: the [notify] urls, the [container] env values
    (secret_urls.SECRET_ENV_KEYS) and a password in [metrics] mlflow_tracking_uri."""
    urls = [redact_url(url) for url in spec.notify.urls]
    env = [redact_env(assignment) for assignment in spec.container.env]
    uri = spec.metrics.mlflow_tracking_uri
    metrics = dataclasses.replace(spec.metrics, mlflow_tracking_uri=None if uri is None else redact_userinfo(uri))
    return dataclasses.replace(spec, notify=dataclasses.replace(spec.notify, urls=urls),
                               container=dataclasses.replace(spec.container, env=env), metrics=metrics)


def spec_to_dict(spec: JobSpec, redact: bool = True) -> dict[str, Any]:
    """Every table and key of ``spec`` as plain dicts, lists and scalars (None where unset);
    secrets redacted unless ``redact`` is False."""
    return dataclasses.asdict(redact_secrets(spec) if redact else spec)


def _without_none(table: dict[str, Any]) -> dict[str, Any]:
    # TOML has no null: an unset optional key is simply absent, which loads back as None.
    return {
        key: _without_none(value) if isinstance(value, dict) else value
        for key, value in table.items()
        if value is not None
    }


def spec_to_toml(spec: JobSpec, redact: bool = True) -> str:
    """The fully resolved spec as TOML text; ``parse_spec`` of it gives an equal JobSpec, but
    for the redacted secrets (``redact=False`` keeps them: only for a file the job reads)."""
    header = "# Resolved relax-hpc job spec: every key, defaults included.\n\n"
    return header + tomli_w.dumps(_without_none(spec_to_dict(spec, redact)))
