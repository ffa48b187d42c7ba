"""Rollout samples/s of the native engine with a GRPO group's prompt prefilled once vs per row.

    python benchmarks/bench_prefill.py [--prompts 8] [--samples 32] [--max-new-tokens 4]
                                       [--repeats 5] [--threads 1]

One step of the tiny task as the rollout role generates it (`--prompts` prompts, each
`--samples` times in one call; the embedded spec's 8 x 32 with 4 new tokens by default) on the
tiny Qwen3 model, in this process, with `torch.set_num_threads(--threads)` (a run gives each
role 1). The engine prefills each distinct prompt once and copies its KV cache to the group's
rows (`share_prefill`, the default); the baseline is the same engine prefilling every row.
After one warm-up call each, `--repeats` pairs of calls alternate which side goes first; the
figure is the median of the pairs' ratios. The last line is the summary:

    shared prefill vs per row: 2.10x (shared 9000 samples/s, per row 4300 samples/s; ...)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from relax_hpc.data.tiny_task import tiny_sum_rows  # noqa: E402
from relax_hpc.engines.base import SamplingParams  # noqa: E402
from relax_hpc.engines.native import NativeEngine  # noqa: E402
from relax_hpc.models.tiny import write_tiny_model  # noqa: E402


def timed(engine: NativeEngine, prompts: list[list[int]], params: SamplingParams, seed: int) -> float:
    t0 = time.perf_counter()
    gens = engine.generate(prompts, params, seed=seed)
    seconds = time.perf_counter() - t0
    assert len(gens) == len(prompts)
    return len(prompts) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", seed=1)
        shared, per_row = NativeEngine(model), NativeEngine(model, share_prefill=False)
        rows = tiny_sum_rows()
        prompts = [shared.tokenizer.apply_chat_template(
                       [{"role": "user", "content": rows[(7 * i) % len(rows)]["prompt"]}],
                       add_generation_prompt=True, tokenize=True, return_dict=False)
                   for i in range(args.prompts) for _ in range(args.samples)]
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        timed(shared, prompts, params, 0)
        timed(per_row, prompts, params, 0)
        ratios, rates_shared, rates_per_row = [], [], []
        for k in range(args.repeats):
            if k % 2 == 0:
                a, b = timed(shared, prompts, params, k), timed(per_row, prompts, params, k)
            else:
                b, a = timed(per_row, prompts, params, k), timed(shared, prompts, params, k)
            rates_shared.append(a)
            rates_per_row.append(b)
            ratios.append(a / b)
            print(f"pair {k + 1}: shared {a:.0f} samples/s, per row {b:.0f} samples/s, {a / b:.2f}x")
    print(f"shared prefill vs per row: {statistics.median(ratios):.2f}x (shared {statistics.median(rates_shared):.0f} "
          f"samples/s, per row {statistics.median(rates_per_row):.0f} samples/s; median of {len(ratios)} pairs: "
          + " ".join(f"{r:.2f}" for r in ratios) + f"; {args.prompts} prompts x {args.samples} samples, "
          f"{args.max_new_tokens} new tokens, {os.cpu_count()} CPUs, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
