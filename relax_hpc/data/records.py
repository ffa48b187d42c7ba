"""Reading dataset rows from JSON lines and Parquet, and reaching nested fields by dotted keys.

`iter_records(path)` yields (location, row) pairs, where location ("file:line" for JSON lines,
"file:row N" for Parquet) is what error messages quote. Parquet needs `pyarrow`, imported only
when a Parquet file is read. Hugging Face's Image / Audio features come out of Parquet as
{"bytes": ..., "path": ...} structs and are passed on as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
# Rows read per Parquet batch: bounds memory on large files with image columns.
PARQUET_BATCH_ROWS = 1024

_MISSING = object()


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        yield from _parquet_records(path)
    elif suffix in JSONL_SUFFIXES:
        yield from _jsonl_records(path)
    else:
        raise ValueError(
            f"dataset {path}: unknown file type {suffix!r}; [data] path must end in "
            f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        )


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() == ".json":  # either one array of rows or JSON lines
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError:
                rows = None  # JSON lines whose first row is an array: reported per line below
            if isinstance(rows, list):
                for number, row in enumerate(rows, 1):
                    yield f"{path}:row {number}", row
                return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line") from e
            yield f"{path}:{lineno}", record


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError(f"reading {path} needs the 'pyarrow' package: pip install pyarrow") from e
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for a file that is not Parquet
        raise ValueError(f"dataset {path} is not a readable Parquet file ({e})") from e
    number = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            yield f"{path}:row {number}", row


def get_dotted(record: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """record[key], or the nested field "a.b.c" names; a literal key containing dots wins.

    Raises KeyError when the path is missing and no default is given.
    """
    if key in record:
        return record[key]
    node: Any = record
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            if default is _MISSING:
                raise KeyError(key)
            return default
    return node


def has_dotted(record: dict[str, Any], key: str) -> bool:
    absent = object()
    return get_dotted(record, key, absent) is not absent
