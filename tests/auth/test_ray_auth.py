"""Ray's token authentication, as `relax-hpc run` turns it on: a local cluster started under a
run's secret refuses `ray.init(address=...)` without the token and with a wrong one.

Everything runs in a child process: Ray reads RAY_AUTH_MODE once per process, at import, and
the test session imported it with authentication off.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Starts Ray the way the driver does, then tries to join it from fresh processes.
PROBE = r'''
import json, os, subprocess, sys
from pathlib import Path
from relax_hpc.driver.credentials import job_secret_env
from relax_hpc.driver.run import start_ray

job_dir, attempts = Path(sys.argv[1]), json.loads(sys.argv[2])
JOIN = "import ray; ray.init(address=%r, logging_level='ERROR'); print('JOINED', flush=True); ray.shutdown()"
with job_secret_env(job_dir, joining=False) as secret_file:
    start_ray(None)
    import ray

    @ray.remote
    def worker_env():
        return {k: os.environ.get(k) for k in ("RELAX_HPC_SECRET_FILE", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}

    result = {"worker_env": ray.get(worker_env.remote()), "secret_file": str(secret_file), "joins": {}}
    address = ray.get_runtime_context().gcs_address
    children = {}
    for label, extra in attempts.items():  # all at once
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RELAX_HPC_SECRET_FILE"}
        env["HOME"] = str(job_dir)  # no ~/.ray/auth_token of the user's to fall back on
        # Every client tries to reach the GCS for 3 s instead of Ray's 20 (the right token's
        # alike, so a refusal is the server's answer, not a client that gave up too soon).
        env["RAY_gcs_server_port_wait_time_s"] = "3"
        env.update(extra)
        children[label] = subprocess.Popen([sys.executable, "-c", JOIN % address], env=env, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for label, child in children.items():
        out, err = child.communicate(timeout=240)
        result["joins"][label] = {"joined": "JOINED" in out, "stderr": err[-2000:]}
    ray.shutdown()
print("RESULT " + json.dumps(result), flush=True)
'''


def test_a_local_run_ray_refuses_clients_without_the_token(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    right = str(job_dir / ".ray_token")
    attempts = {
        "no auth": {"RAY_AUTH_MODE": "disabled"},
        "token mode, no token": {"RAY_AUTH_MODE": "token"},
        "wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        "right token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": right},
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"  # what the run must override for its own cluster
    done = subprocess.run([sys.executable, "-c", PROBE, str(job_dir), json.dumps(attempts)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))

    joins = result["joins"]
    assert joins["right token"]["joined"], joins["right token"]["stderr"]
    for label in ("no auth", "token mode, no token", "wrong token"):
        assert not joins[label]["joined"], f"{label}: a client without the job's token joined Ray"
    # Every Ray worker finds the secret and Ray's token by path.
    assert result["worker_env"] == {"RELAX_HPC_SECRET_FILE": result["secret_file"], "RAY_AUTH_MODE": "token",
                                    "RAY_AUTH_TOKEN_PATH": right}
    for name in (".secret", ".ray_token"):
        assert stat.S_IMODE(os.stat(job_dir / name).st_mode) == 0o600
    # The token file holds the derived token, never the secret itself.
    assert (job_dir / ".ray_token").read_text().strip() != (job_dir / ".secret").read_text().strip()
