"""Rollout samples/s with 1 vs 2 engines behind the router, on this machine.

    python benchmarks/bench_engines.py [--prompts 32] [--samples 32] [--max-new-tokens 32]
                                       [--repeats 3] [--threads 1] [--chunks-per-engine 2]

Each engine is an `EngineHost` Ray actor running the native engine on CPU with `--threads`
intra-op threads (the run gives every role 1), reached through `EngineRouter` exactly as the
rollout role reaches them with `[rollout] num_engines = N`. One step's worth of tiny-task
prompts (`--prompts` groups of `--samples`) is generated as rollout generates it: a sample
ends at EOS or at `--max-new-tokens` (a batch decodes until its longest sample ends). Each side is warmed up once; then `--repeats` pairs
of timed calls alternate which side goes first, and the median of the pairs' ratios is the
figure. The last line is the summary:

    2 engines vs 1: 1.71x (2 engines 2852 samples/s, 1 engine 1643 samples/s; median of 5 pairs: ...)
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

from relax_hpc.data.tiny_task import tiny_sum_rows  # noqa: E402
from relax_hpc.engines.base import SamplingParams  # noqa: E402
from relax_hpc.engines.router import EngineRouter  # noqa: E402
from relax_hpc.models.hf import load_tokenizer  # noqa: E402
from relax_hpc.models.tiny import write_tiny_model  # noqa: E402
from relax_hpc.roles.engine_host import EngineHost, RayEngineClient  # noqa: E402


def router_over(hosts: list, tokenizer, chunks_per_engine: int) -> EngineRouter:
    clients = [RayEngineClient(f"engine-{i}", h) for i, h in enumerate(hosts)]
    return EngineRouter(clients, tokenizer, tokenizer.eos_token_id, chunks_per_engine=chunks_per_engine)


def timed(router: EngineRouter, prompts: list[list[int]], params: SamplingParams, group: int, seed: int) -> float:
    t0 = time.perf_counter()
    gens = router.generate(prompts, params, seed=seed, group_size=group)
    seconds = time.perf_counter() - t0
    assert len(gens) == len(prompts)
    return len(prompts) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunks-per-engine", type=int, default=2,
                        help="chunks of a call per live engine (the router's default: 2)")
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}})
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        write_tiny_model(model, seed=1)
        tokenizer = load_tokenizer(model)
        host = ray.remote(EngineHost).options(num_cpus=0)
        hosts = [host.remote("native", str(model), "float32", "cpu", args.threads) for _ in range(2)]
        one = router_over(hosts[:1], tokenizer, args.chunks_per_engine)
        two = router_over(hosts, tokenizer, args.chunks_per_engine)
        rows = tiny_sum_rows()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": rows[i % len(rows)]["prompt"]}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
                   for i in range(args.prompts) for _ in range(args.samples)]
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        timed(one, prompts, params, args.samples, 0)  # warm-up: both engines load and run once
        timed(two, prompts, params, args.samples, 0)
        ratios, rates_one, rates_two = [], [], []
        for k in range(args.repeats):
            if k % 2 == 0:
                r1, r2 = timed(one, prompts, params, args.samples, k), timed(two, prompts, params, args.samples, k)
            else:
                r2, r1 = timed(two, prompts, params, args.samples, k), timed(one, prompts, params, args.samples, k)
            rates_one.append(r1)
            rates_two.append(r2)
            ratios.append(r2 / r1)
            print(f"pair {k + 1}: 1 engine {r1:.0f} samples/s, 2 engines {r2:.0f} samples/s, {r2 / r1:.2f}x")
    ray.shutdown()
    print(f"2 engines vs 1: {statistics.median(ratios):.2f}x (2 engines {statistics.median(rates_two):.0f} "
          f"samples/s, 1 engine {statistics.median(rates_one):.0f} samples/s; median of {len(ratios)} pairs: "
          + " ".join(f"{r:.2f}" for r in ratios) + f"; {os.cpu_count()} CPUs, {args.threads} thread(s) per engine)")


if __name__ == "__main__":
    main()
