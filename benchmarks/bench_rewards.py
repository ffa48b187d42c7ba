"""Reward scoring cost: worker processes vs threads, and adversarial vs ordinary responses.

    python benchmarks/bench_rewards.py [--samples 256] [--repeats 3]

1. A batch of `--samples` ordinary `dapo` samples (right and wrong "Answer:" lines, fractions,
   small powers) scored by a RewardHub whose plain rewards run in killable worker processes
   (the default) and by one that runs them on threads (`worker_processes = 0`, the old way),
   each warmed up first; the best of `--repeats` batches. What killability costs:

       dapo, 256 samples: workers 0.41 s, threads 0.52 s (workers vs threads 0.79x the time)

2. For each cheap in-thread reward (`multiple_choice`, `gpqa`, `f1`) and for `ifbench`, the
   slowest adversarial response (runs of blanks after "answer is", thousands of unclosed
   \\boxed{ or <answer>, 200 kB of whitespace) against an ordinary response of the same length,
   per sample. A ratio far above 1 means a check that a policy can make slow.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from relax_hpc.data.sample import Sample  # noqa: E402
from relax_hpc.rewards.hub import RewardHub  # noqa: E402
from relax_hpc.rewards.registry import resolve_reward  # noqa: E402

ANSWERS = [("Answer: 34", "34"), ("Answer: \\frac{1}{2}", "0.5"), ("Answer: 2^{10}", "1024"),
           ("Answer: 35", "34"), ("Answer: x^2+2x+1", "(x+1)^2"), ("no answer at all", "7")]


def _sample(text: str, label: Any = None, **metadata: Any) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text,
                  metadata=dict(metadata))


def batch_seconds(hub: RewardHub, samples: int, repeats: int) -> float:
    batch = [_sample("Let me think.\n" + text, label) for text, label in ANSWERS] * (samples // len(ANSWERS) + 1)
    hub.score(batch[: len(ANSWERS) * 4])  # warm-up: workers started, math-verify imported
    best = float("inf")
    for _ in range(repeats):
        fresh = [_sample(s.response_text, s.label) for s in batch[:samples]]
        start = time.perf_counter()
        hub.score(fresh)
        best = min(best, time.perf_counter() - start)
    return best


ADVERSARIAL = {
    "blank runs after 'answer is'": ("answer is" + " \t" * 100) * 40,
    "unclosed \\boxed{": "\\boxed{" * 30_000,
    "unclosed <answer>": "<answer>" * 25_000,
    "200 kB of whitespace": "a" + " " * 200_000 + "b",
    "newlines and stars": ("*\n" * 50 + "***\n") * 2_000,
}
IFBENCH_ROW = {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words",
                                       "detectable_format:number_highlighted_sections", "detectable_format:title",
                                       "startend:end_checker"],
               "kwargs": [{}, {"relation": "at least", "num_words": 5}, {"num_highlights": 2}, {},
                          {"end_phrase": "Is there anything else I can help with?"}]}


def per_sample_seconds(fn: Callable[[Sample], Any], text: str, label: Any, metadata: dict[str, Any]) -> float:
    sample = _sample(text, label, **metadata)
    fn(sample)  # warm-up (tokenizer models, regex compilation)
    start = time.perf_counter()
    fn(sample)
    return time.perf_counter() - start


def adversarial_lines() -> list[str]:
    lines = []
    for name in ("multiple_choice", "gpqa", "f1", "ifbench"):
        fn = resolve_reward(name)
        metadata = IFBENCH_ROW if name == "ifbench" else {}
        worst_name, worst, ordinary = "", 0.0, 0.0
        for case, text in ADVERSARIAL.items():
            took = per_sample_seconds(fn, text, "B", metadata)
            if took > worst:
                plain = ("The answer is B, as shown. " * (len(text) // 27 + 1))[: len(text)]
                worst_name, worst, ordinary = case, took, per_sample_seconds(fn, plain, "B", metadata)
        lines.append(f"{name}: worst adversarial ({worst_name}) {worst * 1e3:.2f} ms vs ordinary "
                     f"{ordinary * 1e3:.2f} ms per sample ({worst / max(ordinary, 1e-9):.2f}x)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for line in adversarial_lines():
        print(line, flush=True)
    timings = {}
    for label, processes in (("workers", None), ("threads", 0)):
        hub = RewardHub("dapo", timeout_s=30, worker_processes=processes)
        try:
            timings[label] = batch_seconds(hub, args.samples, args.repeats)
        finally:
            hub.close()
    print(f"dapo, {args.samples} samples: workers {timings['workers']:.2f} s, threads {timings['threads']:.2f} s "
          f"(workers vs threads {timings['workers'] / timings['threads']:.2f}x the time)")


if __name__ == "__main__":
    main()
