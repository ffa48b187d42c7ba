"""The job secret: one random key per job, and everything derived from it.

    secret = JobSecret.generate()          # at submit (Slurm) or at the start of a local run
    write_job_secret(job_dir, secret)      # JOBDIR/.secret and JOBDIR/.ray_token, both 0600
    secret = job_secret()                  # in any process of the job: the file that
                                           # RELAX_HPC_SECRET_FILE names, loaded once

The key never appears on a command line, in the rendered sbatch script or in a log: processes
find it through the *path* in ``RELAX_HPC_SECRET_FILE``, and ``repr`` hides it. Each listener
uses its own derived value (HMAC-SHA256 of the key and a purpose string), so a value one
component leaks (Ray's token sits in a file Ray reads) does not open the others:

* ``token("ray")``: Ray's token authentication (``RAY_AUTH_TOKEN_PATH`` -> JOBDIR/.ray_token);
* ``derive("queue/server")``, ``derive("queue/client")``: the transfer queue's CURVE keys;
* ``token("engine-http")``, ``token("agent-proxy")``: the bearer tokens of the engine HTTP
  server and of the agent proxy;
* ``store_prefix(name)``, ``derive("store/" + name)``: a TCPStore's key prefix and the key that
  seals its values (trainer rendezvous, weight channel).

See docs/security.md, "Authentication".
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "RAY_TOKEN_FILE",
    "SECRET_ENV",
    "SECRET_FILE",
    "JobSecret",
    "JobSecretError",
    "bearer_matches",
    "job_secret",
    "write_job_secret",
    "write_private_text",
]

SECRET_ENV = "RELAX_HPC_SECRET_FILE"
SECRET_FILE = ".secret"
RAY_TOKEN_FILE = ".ray_token"
_KEY_BYTES = 32
_PREFIX = b"relax-hpc/"


class JobSecretError(ValueError):
    """The job secret is missing, unreadable, malformed or readable by others.

    A ValueError, like the other problems a user fixes before re-running (the CLI prints it on
    one line).
    """


@dataclass(frozen=True)
class JobSecret:
    """A 32-byte random key. Compare and derive; never print."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) != _KEY_BYTES:
            raise JobSecretError(f"a job secret is {_KEY_BYTES} bytes; got {len(self.key)}")

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    @classmethod
    def generate(cls) -> JobSecret:
        return cls(secrets.token_bytes(_KEY_BYTES))

    @classmethod
    def load(cls, path: Path | str) -> JobSecret:
        """Read a secret file; refuse one that group or others can read or that is not ours."""
        path = Path(path)
        try:
            st = os.stat(path)
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            raise JobSecretError(
                f"job secret file {path} does not exist; `relax-hpc submit` writes it into the job "
                "directory (resubmit the job, or unset RELAX_HPC_SECRET_FILE for a local run)"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise JobSecretError(f"cannot read the job secret file {path}: {exc}") from None
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise JobSecretError(
                f"job secret file {path} has mode {stat.S_IMODE(st.st_mode):o}: others could read it "
                "and reach the job's listeners; `chmod 600` it, or resubmit for a fresh secret"
            )
        if st.st_uid != os.getuid() and os.getuid() != 0:
            raise JobSecretError(f"job secret file {path} belongs to uid {st.st_uid}, not to you; resubmit the job")
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != _KEY_BYTES:
            raise JobSecretError(
                f"job secret file {path} is not {_KEY_BYTES * 2} hex digits; resubmit the job for a fresh one"
            )
        return cls(key)

    def hex(self) -> str:
        """The file form; write it only into an owner-only file."""
        return self.key.hex()

    def derive(self, purpose: str) -> bytes:
        """32 bytes for one purpose: HMAC-SHA256(key, "relax-hpc/" + purpose)."""
        return hmac.new(self.key, _PREFIX + purpose.encode(), hashlib.sha256).digest()

    def token(self, purpose: str) -> str:
        """A printable token (64 hex digits) for one purpose: HTTP bearer tokens, Ray's token."""
        return self.derive(purpose).hex()

    def store_prefix(self, name: str) -> str:
        """A TCPStore key prefix nobody without the secret can guess (``name`` keeps stores apart)."""
        return f"{name}/{self.token('store/' + name)[:32]}/"


def bearer_matches(header: str | None, expected_token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <expected_token>``, compared in
    constant time."""
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), expected_token.encode())


def write_private_text(path: Path, text: str) -> None:
    """Write-then-rename into a 0600 file (created owner-only, never widened by the umask)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_job_secret(job_dir: Path, secret: JobSecret) -> Path:
    """Write JOBDIR/.secret and JOBDIR/.ray_token (Ray's derived token), both 0600; returns the
    secret file's path, the value for ``RELAX_HPC_SECRET_FILE``."""
    job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private_text(job_dir / RAY_TOKEN_FILE, secret.token("ray") + "\n")
    write_private_text(job_dir / SECRET_FILE, secret.hex() + "\n")
    return job_dir / SECRET_FILE


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> JobSecret:
    return JobSecret.load(path)


def job_secret() -> JobSecret:
    """This job's secret: the file ``RELAX_HPC_SECRET_FILE`` names (set by the job script and by
    `relax-hpc run` for every process it starts)."""
    path = os.environ.get(SECRET_ENV)
    if not path:
        raise JobSecretError(
            f"{SECRET_ENV} is not set, so this process cannot authenticate to the job's listeners; "
            "start it through `relax-hpc run` or the job script, or point it at JOBDIR/.secret"
        )
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        mtime = 0  # load() names the problem
    return _load_cached(path, mtime)
