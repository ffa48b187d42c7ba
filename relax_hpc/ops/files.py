"""Small files the run rewrites while it lives (heartbeats, status.json): owner-only, atomic.

The ckpt package has the durable variant (fsync, relax_hpc/ckpt/fs.py); these are rewritten every
few seconds and a crash only loses the newest, so they skip the fsync.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private_text(path: Path, text: str) -> None:
    """Write-then-rename, mode 0600, creating the directory (0700) when missing; a reader sees
    the old file or the new one, never a part."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
