"""A rollout step's rows, built one by one (`sample_to_row`) against by column (`samples_to_rows`).

    python benchmarks/bench_rows.py [--samples 16384] [--repeats 5] [--seed 0]

Builds one step's samples as the fleet simulation's 256 engines make them (a 32-token prompt,
response lengths lognormal with median 128 and sigma 1, cut at 1024), then times, in one
process and alternating: building the rows and encoding them for the queue's wire
(`encode_blocks` plus the header, what a put does before it sends), both ways. The rows are
checked equal first. It prints the median of `--repeats` for each part and the ratios, e.g.

    rows by column: build 0.29 s vs 0.49 s one by one (0.59x), encode 0.015 s vs 0.31 s (0.05x); 16384 samples
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from relax_hpc.data.rows import sample_to_row, samples_to_rows
from relax_hpc.data.sample import Sample
from relax_hpc.transfer.wire import pack_header
from relax_hpc.transfer.wire_encode import blocks_to_wire, encode_blocks

PROMPT_LEN = 32
MEDIAN, SIGMA, MAX_NEW_TOKENS = 128.0, 1.0, 1024


def step_samples(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = min(MAX_NEW_TOKENS, max(1, int(rng.lognormvariate(math.log(MEDIAN), SIGMA))))
        samples.append(Sample(prompt_ids=[3] * PROMPT_LEN, response_ids=[5] * length, rollout_log_probs=[-1.0] * length,
                              weight_version=1, group_id=i // 8, prompt_index=i // 8, reward=float(i % 2),
                              raw_reward=float(i % 2), advantage=0.5 - i % 2, sample_id=i))
    return samples


def encode(rows: Sequence[dict[str, Any]]) -> int:
    """What a put does before it sends: the columns, their descriptors, the header; its bytes."""
    frames: list[Any] = []
    header = pack_header({"op": "put", "blocks": blocks_to_wire(encode_blocks(rows), frames)})
    return len(header) + sum(memoryview(f).nbytes for f in frames)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def same_rows(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return type(x) is type(y) and x == y
    return len(a) == len(b) and all(
        list(r) == list(s) and all(same(r[k], s[k]) for k in s) for r, s in zip(a, b))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16384, help="rows in the step (256 engines x 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    samples = step_samples(args.samples, args.seed)
    if not same_rows(list(samples_to_rows(samples)), [sample_to_row(s) for s in samples]):
        raise SystemExit("bench_rows: the rows built by column differ from those built one by one")
    parts: dict[str, list[float]] = {k: [] for k in ("build_rows", "encode_rows", "build_columns", "encode_columns")}
    gc.collect()
    gc.freeze()  # the samples are the long-lived heap here, as a settled role's is
    try:
        _measure(samples, args.repeats, parts)
    finally:
        gc.unfreeze()
    med = {k: statistics.median(v) for k, v in parts.items()}
    print(f"rows by column: build {med['build_columns']:.3f} s vs {med['build_rows']:.3f} s one by one "
          f"({med['build_columns'] / med['build_rows']:.2f}x), encode {med['encode_columns']:.3f} s vs "
          f"{med['encode_rows']:.3f} s ({med['encode_columns'] / med['encode_rows']:.2f}x); {args.samples} samples, "
          f"median of {args.repeats}")
    return med


def _measure(samples: list[Sample], repeats: int, parts: dict[str, list[float]]) -> None:
    """Alternating, so that a change in the host's load hits both builds alike."""
    for _ in range(repeats):
        seconds, rows = timed(lambda: [sample_to_row(s) for s in samples])
        parts["build_rows"].append(seconds)
        parts["encode_rows"].append(timed(lambda: encode(rows))[0])
        del rows
        seconds, columns = timed(lambda: samples_to_rows(samples))
        parts["build_columns"].append(seconds)
        parts["encode_columns"].append(timed(lambda: encode(columns))[0])
        del columns


if __name__ == "__main__":
    main()
