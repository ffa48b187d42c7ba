"""settle_heap: once per process, the objects alive then leave the collector's reach and later
collections come less often."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_settle_heap_freezes_what_is_alive_once_per_process() -> None:
    # In a child process: freezing the test runner's own heap would outlive this test.
    code = textwrap.dedent("""
        import gc
        from relax_hpc.ops.heap import settle_heap
        keep = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == 0
        assert settle_heap() is True
        frozen = gc.get_freeze_count()
        assert frozen > 1000, frozen
        assert gc.get_threshold() == (100_000, 50, 100)  # collections spaced out from now on
        later = [[i] for i in range(1000)]
        assert settle_heap() is False  # once: later objects stay collectable
        assert gc.get_freeze_count() == frozen
        print("ok", frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
