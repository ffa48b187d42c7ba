"""Fully-async vs colocate on the tiny task: steps/s and reward at equal steps, measured in one run.

    python benchmarks/bench_async.py [--steps 300] [--max-staleness 1] [--quick] [--repeats 3]

Both modes run the same spec (jobspecs/tiny_local.toml, or --spec) through `relax-hpc run`'s code
path on a local Ray cluster, from the same freshly built tiny model, into a temporary job dir.
Async mode adds truncated importance sampling (tis_cap 2.0): samples generated one step earlier
are weighted by the ratio of the current policy to the one that generated them.
Steps/s counts the training loop only (Ray start-up and model loading excluded) from the
per-step times in metrics.jsonl. Each mode's reward is the mean `reward/mean` of its last 20
steps; the reward gap is colocate's minus async's (positive: async learned less in as many
steps). With ``--repeats N`` it runs N pairs, alternating which mode goes first, and reports the
median of the pairs' speed-ups and of their reward gaps, then each pair's (the host's speed
drifts between runs; both runs of a pair see about the same host). The last line is the summary
a script can read:

    async speedup 1.60x (colocate 12.6 steps/s, async 21.1 steps/s); reward gap: 0.02 (colocate 0.92, async 0.90, mean of the last 20 steps)

and with ``--repeats 3``:

    async speedup 1.60x (colocate 12.6 steps/s, async 21.1 steps/s; pairs 1.72 1.60 1.54); reward gap: 0.02 (colocate 0.92, async 0.90, mean of the last 20 steps; pairs 0.01 0.02 0.03)

Steps/s and rewards in it are the medians over the pairs. Every pair runs the spec's seed, and
both modes are nearly deterministic, so repeats measure the host, not the reward; with
``--vary-seed`` pair k runs both modes with [job] seed + k, and the gap becomes a median over
seeds (docs/benchmarks.md, "Async vs colocate": one seed's gap is mostly that seed's luck).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FINAL_STEPS = 20  # each mode's reward: the mean of its last FINAL_STEPS steps

# One mode's result: (training steps per second, mean reward of the last FINAL_STEPS steps).
Result = tuple[float, float]


def spec_text(base: str, model_dir: Path, job_dir: Path, steps: int, mode: str, staleness: int,
              tis_cap: float | None, seed: int | None = None) -> str:
    text = re.sub(r'(?m)^path = "runs/models/tiny-qwen3"', f'path = "{model_dir}"', base)
    text = re.sub(r'(?m)^build_tiny_if_missing = .*$', "build_tiny_if_missing = false", text)
    text = re.sub(r'(?m)^name = ".*"', f'name = "bench_{mode}"\noutput_dir = "{job_dir}"', text, count=1)
    text = re.sub(r'(?m)^mode = ".*"', f'mode = "{mode}"', text)
    tis = f"\ntis_cap = {tis_cap}" if tis_cap else ""
    text = re.sub(r'(?m)^max_staleness = \d+', f"max_staleness = {staleness}{tis}", text)
    text = re.sub(r'(?m)^trajectory_archive = true.*$', "trajectory_archive = false", text)
    text = re.sub(r'(?m)^steps = \d+', f"steps = {steps}", text)
    text = re.sub(r'(?m)^save_interval = \d+', f"save_interval = {steps}", text)
    text = re.sub(r'(?m)^path = "jobspecs/', f'path = "{REPO}/jobspecs/', text)
    if seed is not None:
        text = re.sub(r'(?m)^seed = \d+', f"seed = {seed}", text, count=1)
    return text


def _run_job(text: str, name: str) -> None:
    from relax_hpc.driver.run import run_job
    from relax_hpc.spec import parse_spec

    run_job(parse_spec(text, name), progress=False)


def run_mode(base: str, model_dir: Path, root: Path, steps: int, mode: str, staleness: int,
             tis_cap: float | None = None, run: int = 0, seed: int | None = None) -> Result:
    from relax_hpc.ops.metrics import read_metrics

    job_dir = root / f"{mode}-{run}"  # a fresh job dir per run: nothing to resume
    text = spec_text(base, model_dir, job_dir, steps, mode, staleness, tis_cap, seed)
    # Each run in a fresh process: a local run turns on Ray's token authentication with a token
    # of its own, and a second run in the same process is refused by its own cluster.
    proc = multiprocessing.get_context("spawn").Process(target=_run_job, args=(text, f"<bench {mode}>"))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"the {mode} run failed (exit code {proc.exitcode}); its error is above")
    rows = read_metrics(job_dir / "metrics.jsonl")
    # Skip the first steps: they include actor/engine warm-up.
    warm = rows[min(5, len(rows) - 1):]
    steps_per_s = len(warm) / sum(r["time/step_s"] for r in warm)
    return steps_per_s, final_reward([r["reward/mean"] for r in rows])


def final_reward(rewards: list[float], last: int = FINAL_STEPS) -> float:
    """The mean of the last `last` steps' rewards (all of them when there are fewer)."""
    tail = rewards[-last:]
    return sum(tail) / len(tail)


def summary_line(pairs: list[tuple[Result, Result]], last: int = FINAL_STEPS) -> str:
    """The last line the benchmark prints, from (colocate, async) result pairs.

    The speed-up and the reward gap (colocate's reward minus async's) are the medians of the
    pairs' own; the steps/s and rewards shown are the medians of each mode's. With several pairs
    each pair's figure follows.
    """
    if not pairs:
        raise ValueError("no pair of runs to summarise")
    ratios = [a[0] / c[0] for c, a in pairs]
    gaps = [c[1] - a[1] for c, a in pairs]
    colocate = [statistics.median(c[i] for c, _ in pairs) for i in (0, 1)]
    fully_async = [statistics.median(a[i] for _, a in pairs) for i in (0, 1)]
    several = len(pairs) > 1
    speed_pairs = f"; pairs {' '.join(f'{r:.2f}' for r in ratios)}" if several else ""
    gap_pairs = f"; pairs {' '.join(f'{g:.2f}' for g in gaps)}" if several else ""
    return (f"async speedup {statistics.median(ratios):.2f}x (colocate {colocate[0]:.1f} steps/s, "
            f"async {fully_async[0]:.1f} steps/s{speed_pairs}); "
            f"reward gap: {statistics.median(gaps):.2f} (colocate {colocate[1]:.2f}, async {fully_async[1]:.2f}, "
            f"mean of the last {last} steps{gap_pairs})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "jobspecs" / "tiny_local.toml"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--tis-cap", type=float, default=2.0,
                        help="truncated importance sampling cap in async mode (corrects for stale samples; 0: off)")
    parser.add_argument("--quick", action="store_true", help="60 steps: timing only, rewards not converged")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pairs of runs (the mode that goes first alternates); the medians are reported")
    parser.add_argument("--vary-seed", action="store_true",
                        help="pair k runs both modes with [job] seed = the spec's + k: the reward gap is then "
                             "a median over seeds (one seed's gap is mostly that seed's luck)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: needs at least 1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    steps = 60 if args.quick else args.steps
    from relax_hpc.models.tiny import write_tiny_model

    base = Path(args.spec).read_text()
    # [job] seed (1 when the spec leaves it to the default)
    first_seed = int(m.group(1)) if (m := re.search(r'(?m)^seed = (\d+)', base)) else 1
    with tempfile.TemporaryDirectory(prefix="relax-bench-async-") as tmp:
        root = Path(tmp)
        model_dir = write_tiny_model(root / "model", seed=1)
        pairs: list[tuple[Result, Result]] = []
        for run in range(args.repeats):
            results: dict[str, Result] = {}
            seed = first_seed + run if args.vary_seed else None
            for mode in (("colocate", "async") if run % 2 == 0 else ("async", "colocate")):
                if mode == "colocate":
                    results[mode] = run_mode(base, model_dir, root, steps, "colocate", 0, run=run, seed=seed)
                    label = "colocate"
                else:
                    results[mode] = run_mode(base, model_dir, root, steps, "async", args.max_staleness,
                                             args.tis_cap, run=run, seed=seed)
                    label = f"async (max_staleness {args.max_staleness})"
                if seed is not None:
                    label += f", seed {seed}"
                print(f"{label}: {results[mode][0]:.2f} steps/s, reward {results[mode][1]:.3f} "
                      f"(mean of the last {FINAL_STEPS} steps)", flush=True)
            pairs.append((results["colocate"], results["async"]))
    print(summary_line(pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
