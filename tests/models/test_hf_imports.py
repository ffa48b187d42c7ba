"""transformers 5's lazy module fails two threads' first imports now and then ("cannot import name
'AutoTokenizer'"): relax-hpc takes every transformers name through `transformers_name`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter (transformers not imported yet), eight threads released at once, each
# asking for a name the rollout worker's and the media processor's threads ask for. With a plain
# `import transformers; getattr(transformers, name)` instead, 7 of the 8 threads failed in 2 of 4
# runs on a 2-core machine (transformers 5.24.0, 2026-11-28).
PROBE = """
import threading
from concurrent.futures import ThreadPoolExecutor
from relax_hpc.models.hf import transformers_name

names = ["AutoTokenizer", "AutoModelForCausalLM", "AutoConfig", "AutoImageProcessor",
         "AutoFeatureExtractor", "AutoTokenizer", "AutoModelForCausalLM", "AutoConfig"]
start = threading.Barrier(len(names))

def first_use(name):
    start.wait()
    return transformers_name(name).__name__

with ThreadPoolExecutor(len(names)) as pool:
    print(sorted(set(pool.map(first_use, names))))
"""


def test_first_imports_from_eight_threads_at_once_all_succeed() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(sorted({"AutoTokenizer", "AutoModelForCausalLM", "AutoConfig",
                                              "AutoImageProcessor", "AutoFeatureExtractor"}))
