"""A dataset cell -> the bytes of one media file, before any decoding.

A cell names its media in one of these forms:

- a path, absolute or relative to the data file's directory (`base_dir`), or a `file://` URL;
- a `data:<mime>;base64,<...>` URL (what an agent or an OpenAI-style message carries);
- raw `bytes` (a Parquet binary column);
- a dict `{"bytes": ..., "path": ...}`, which is how Hugging Face `datasets` stores its Image and
  Audio features in Parquet: the bytes win, else the path.

Remote URLs (`http://`, `s3://`, `hf://`, ...) are refused: compute nodes usually have no network,
and a training step must not wait on one. Every refusal is a `MediaError` whose `reason` is short
enough to count dropped rows by.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from relax_hpc.media.items import MediaError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NAME_CHARS = 80  # how much of a long cell value an error message quotes


def read_source(value: object, *, base_dir: Path, max_bytes: int) -> tuple[bytes, str]:
    """The bytes a cell names and a short name for messages (the path, or what kind of cell)."""
    if isinstance(value, dict):
        return _read_hf_dict(value, base_dir=base_dir, max_bytes=max_bytes)
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        _check_size(len(data), max_bytes, "bytes cell")
        return data, f"bytes cell ({len(data)} bytes)"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        if value.startswith("data:"):
            return _read_data_url(value, max_bytes=max_bytes)
        if match := _SCHEME.match(value):
            return _read_url(value, match.group(1).lower(), base_dir=base_dir, max_bytes=max_bytes)
        return _read_path(Path(value).expanduser(), base_dir=base_dir, max_bytes=max_bytes)
    raise MediaError(
        "unsupported cell type",
        f"a media cell must be a path, a data: URL, bytes or a {{'bytes', 'path'}} dict, got {type(value).__name__}",
    )


def _short(text: str) -> str:
    return text if len(text) <= _NAME_CHARS else text[: _NAME_CHARS - 3] + "..."


def _check_size(size: int, max_bytes: int, name: str) -> None:
    if size > max_bytes:
        raise MediaError(
            f"larger than max_media_bytes={max_bytes}",
            f"{name} has {size} bytes; raise the limit or shrink the media",
        )


def _read_hf_dict(value: dict, *, base_dir: Path, max_bytes: int) -> tuple[bytes, str]:
    data, path = value.get("bytes"), value.get("path")
    if data:
        name = f"bytes cell of {_short(str(path))}" if path else "bytes cell"
        _check_size(len(data), max_bytes, name)
        return bytes(data), name
    if path:
        return read_source(path, base_dir=base_dir, max_bytes=max_bytes)
    raise MediaError("empty cell", f"a {{'bytes', 'path'}} dict with neither set (keys {sorted(value)})")


def _read_data_url(url: str, *, max_bytes: int) -> tuple[bytes, str]:
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("malformed data URL", f"no ',' after the header in {_short(url)!r}")
    mime = header[len("data:") :].split(";")[0] or "text/plain"
    is_base64 = header.split(";")[-1].lower() == "base64"
    # Checked before decoding: every 4 base64 characters (padding aside) carry 3 bytes.
    size = len(payload.rstrip("=")) * 3 // 4 if is_base64 else len(payload)
    _check_size(size, max_bytes, f"data URL ({mime})")
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise MediaError("malformed data URL", f"{mime} payload is not valid base64: {e}") from e
    return data, f"data URL ({mime}, {len(data)} bytes)"


def _read_url(url: str, scheme: str, *, base_dir: Path, max_bytes: int) -> tuple[bytes, str]:
    if scheme != "file":
        raise MediaError(
            "remote URL refused",
            f"{_short(url)!r} is a {scheme}:// URL; compute nodes usually have no network, so "
            f"download the media next to the data file ({base_dir}) and name it by a relative path",
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(
            "malformed file URL",
            f"{_short(url)!r} names host {parts.netloc!r}; write file:///absolute/path or a plain path",
        )
    return _read_path(Path(unquote(parts.path)), base_dir=base_dir, max_bytes=max_bytes)


def _read_path(path: Path, *, base_dir: Path, max_bytes: int) -> tuple[bytes, str]:
    full = path if path.is_absolute() else Path(base_dir) / path
    name = str(path)
    try:
        size = full.stat().st_size
    except OSError as e:
        raise MediaError("missing file", f"{full} ({e.strerror or e})") from e
    if not full.is_file():
        raise MediaError("missing file", f"{full} is not a regular file")
    _check_size(size, max_bytes, name)
    try:
        with open(full, "rb") as f:
            data = f.read(max_bytes + 1)  # the file may have grown since stat()
    except OSError as e:
        raise MediaError("unreadable file", f"{full} ({e.strerror or e})") from e
    _check_size(len(data), max_bytes, name)
    return data, name
