"""The engine server's bearer token: checking it on every request, and handing it to a user.

Inside a job the token is derived from the job secret (`engine_token()`), so every process of
the job can compute it; `relax-hpc serve-engine` run by hand makes a fresh one per run and writes
it to an owner-only file (`write_token_file`), whose path it prints, never the token itself.
The server checks it in an ASGI middleware, from the headers alone (http/server.py).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from relax_hpc.auth import job_secret, write_private_text

__all__ = [
    "ENGINE_AUTH_MESSAGE",
    "ENGINE_TOKEN_PURPOSE",
    "check_token",
    "default_token_file",
    "engine_token",
    "read_token_file",
    "write_token_file",
]

ENGINE_TOKEN_PURPOSE = "engine-http"
ENGINE_AUTH_MESSAGE = (
    "missing or wrong bearer token: send 'Authorization: Bearer <token>'; the engine's token is "
    f"JobSecret.token('{ENGINE_TOKEN_PURPOSE}') of the job secret, or the file `relax-hpc serve-engine` printed"
)
MIN_TOKEN_CHARS = 32  # JobSecret tokens have 64; a short one could be guessed


def engine_token() -> str:
    """This job's engine token (RELAX_HPC_SECRET_FILE names the secret): what callers in the job pass."""
    return job_secret().token(ENGINE_TOKEN_PURPOSE)


def check_token(token: str, owner: str) -> str:
    """`token` when it can serve as a bearer token; ValueError naming `owner` otherwise."""
    usable = isinstance(token, str) and len(token) >= MIN_TOKEN_CHARS and token.isascii() and token.isprintable()
    if not usable or " " in token:
        raise ValueError(f"{owner} needs a bearer token of at least {MIN_TOKEN_CHARS} printable ASCII characters "
                         "without spaces, e.g. JobSecret.token(purpose) of the job secret")
    return token


def default_token_file(port: int) -> Path:
    """~/.relax-hpc/engine-<host>-<port>.token: the user's own directory, which a cluster shares
    between nodes, so a client on another node can read it; host and port keep servers apart."""
    return Path.home() / ".relax-hpc" / f"engine-{socket.gethostname()}-{port}.token"


def write_token_file(path: Path, token: str) -> Path:
    """Write `token` into `path`, created 0600 through a temp file and a rename; a directory it
    creates is 0700. Returns the path."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private_text(path, token + "\n")
    return path


def read_token_file(path: Path) -> str:
    """The bearer token in `path` (what `write_token_file` wrote, or an SGLang server's
    --api-key saved by hand); ValueError when it is missing, readable by others, or no token."""
    path = path.expanduser()
    try:
        st = os.stat(path)
        token = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the engine token file {path} ({exc}); point [reward] genrm_token_file "
                         "at the file `relax-hpc serve-engine` printed") from None
    if st.st_mode & 0o077:
        raise ValueError(f"engine token file {path} has mode {st.st_mode & 0o777:o}: others could read the token; "
                         "`chmod 600` it")
    return check_token(token, f"the engine token file {path}")
