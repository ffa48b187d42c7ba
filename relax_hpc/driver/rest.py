"""The driver's REST API: served while the job runs, its URL published in JOBDIR/cluster.json.

Grow jobs, `relax-hpc status` and `relax-hpc shrink` find the API there, and authenticate with
the job's REST token (derived from JOBDIR/.secret, docs/security.md). The requests themselves
are answered by the rollout role (`Roles.elastic`), which owns the engines; see
docs/federation.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from relax_hpc.auth import SECRET_ENV
from relax_hpc.auth.secret import write_private_text
from relax_hpc.engines.elastic.api import CLUSTER_JSON, ElasticControl
from relax_hpc.engines.elastic.rest_api import RestServer, make_rest_app, rest_token
from relax_hpc.ops.files import UnsafePathError, read_private_text

log = logging.getLogger(__name__)


def serve_rest_api(job_dir: Path, control: ElasticControl, host: str) -> RestServer:
    """Start the API on `host` (a free port) and publish its URL."""
    server = RestServer(make_rest_app(control, rest_token()), host).start()
    publish_rest_url(job_dir, server.url)
    return server


def publish_rest_url(job_dir: Path, url: str | None) -> None:
    """Set `rest_url` in JOBDIR/cluster.json (owner-only, write-then-rename), keeping what the
    job script wrote there; None when the API stops (the run ended). A cluster.json that is not
    a private file of ours (a symbolic link, another user's, writable by others) is not trusted:
    it is replaced whole, with a warning."""
    path = job_dir / CLUSTER_JSON
    try:
        text = read_private_text(path, "cluster.json")
        content = json.loads(text) if text is not None else {}
    except UnsafePathError as exc:
        log.warning("%s; replacing it with one of this run's own", exc)
        content = {}
    except ValueError:
        content = {}  # a torn file from an older writer: rewritten whole below
    if not isinstance(content, dict):
        content = {}
    content.setdefault("job_id", None)
    content.setdefault("secret_file", os.environ.get(SECRET_ENV))
    content["rest_url"] = url
    content["rest_published_at"] = time.time()
    write_private_text(path, json.dumps(content, indent=2))
