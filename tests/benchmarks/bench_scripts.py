"""For the tests of scripts under benchmarks/: import one as a module."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """benchmarks/NAME.py imported by name, with benchmarks/ on the path while the block runs
    (the scripts import one another, and a process spawned meanwhile imports them the same way)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
