"""benchmarks/bench_rows.py: it checks the two builds give the same rows, then prints its line."""

from __future__ import annotations

import re

import pytest
from bench_scripts import benchmark_module


def test_prints_both_builds_and_their_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    with benchmark_module("bench_rows") as bench:
        medians = bench.main(["--samples", "64", "--repeats", "2"])
        samples = bench.step_samples(64, 0)
    assert set(medians) == {"build_rows", "encode_rows", "build_columns", "encode_columns"}
    assert all(v > 0 for v in medians.values())
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"rows by column: build \d+\.\d{3} s vs \d+\.\d{3} s one by one \(\d+\.\d\dx\), encode "
                        r"\d+\.\d{3} s vs \d+\.\d{3} s \(\d+\.\d\dx\); 64 samples, median of 2", line), line
    lengths = [len(s.response_ids) for s in samples]  # the fleet's response lengths: 1..1024, long-tailed
    assert 1 <= min(lengths) and max(lengths) <= 1024 and len(set(lengths)) > 10


def test_rows_that_differ_stop_the_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    with benchmark_module("bench_rows") as bench:
        monkeypatch.setattr(bench, "samples_to_rows", lambda samples: [{"tokens": 0} for _ in samples])
        with pytest.raises(SystemExit, match="differ"):
            bench.main(["--samples", "8", "--repeats", "1"])
