"""benchmarks/bench_omni_step.py --quick: one small omni step through the real queue on both
paths (server, 2 producers and 2 consumers in their own processes), and its final lines."""

from __future__ import annotations

import re

import pytest
from bench_scripts import benchmark_module

FINAL = re.compile(r"omni step: moved (\d+\.\d\d) GB for (\d+\.\d\d) GB unique = (\d+\.\d\d)x; server peak memory "
                   r"(\d+\.\d\d) GB = (\d+\.\d\d)x one step's media \((tcp|shm); median of (\d+)\)")


def test_quick_step_prints_consistent_figures_for_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    with benchmark_module("bench_omni_step") as bench:
        summaries = bench.main(["--quick"])
        gb = bench.GB
    lines = capsys.readouterr().out.strip().splitlines()
    assert set(summaries) == {"tcp", "shm"}
    for line, path in zip(lines[-2:], ("tcp", "shm")):
        match = FINAL.fullmatch(line)
        assert match, line
        moved, unique, ratio, peak, peak_ratio = (float(match[k]) for k in range(1, 6))
        s = summaries[path]
        assert (match[6], int(match[7])) == (path, 2)
        # Every sample row carries its prompt's media: 8 copies put, the same bytes got again.
        assert s.moved >= s.row_bytes >= 8 * s.unique > 0
        assert s.moved == pytest.approx(2 * s.row_bytes, rel=1e-6)
        assert (moved, unique, peak) == (round(s.moved / gb, 2), round(s.unique / gb, 2), round(s.peak_memory / gb, 2))
        assert ratio == round(s.moved / s.unique, 2) and peak_ratio == round(s.peak_memory / s.unique, 2)
        assert s.gbps > 0 and s.server_peak > 0
    assert summaries["tcp"].shm_peak == 0 and summaries["shm"].shm_peak >= summaries["shm"].row_bytes
