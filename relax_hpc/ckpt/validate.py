"""Cheap structural checks of a DCP checkpoint directory, before loading it in place.

``dcp.load`` copies into the live model and optimizer tensors, so a checkpoint that
fails half-way leaves them partly overwritten. Reading ``.metadata`` and comparing
every referenced file's size with the byte ranges it must hold catches the common
damage (a crash or a full disk: missing or truncated files) while nothing is touched.
It cannot catch flipped bits inside a file; DCP stores no checksums.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

__all__ = ["check_dcp_files"]


def check_dcp_files(path: Path) -> None:
    """Raise ValueError/OSError when ``path`` is not a complete DCP checkpoint."""
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path / '.metadata'} is missing (not a complete DCP checkpoint)")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise ValueError(f"{path / '.metadata'} cannot be read: {type(exc).__name__}: {exc}") from exc
    needed: dict[str, int] = {}
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        end = int(info.offset) + int(info.length)
        needed[relative] = max(needed.get(relative, 0), end)
    for relative, end in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing; .metadata lists data in it")
        size = file.stat().st_size
        if size < end:
            raise ValueError(f"{file} is truncated: {size} bytes, .metadata needs at least {end}")
