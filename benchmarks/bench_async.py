"""Fully-async vs colocate on the tiny task: steps/s and final reward, measured in one run.

    python benchmarks/bench_async.py [--steps 300] [--max-staleness 1] [--quick] [--repeats 3]

Both modes run the same spec (jobspecs/tiny_local.toml, or --spec) through `relax-hpc run`'s code
path on a local Ray cluster, from the same freshly built tiny model, into a temporary job dir.
Async mode adds truncated importance sampling (tis_cap 2.0): samples generated one step earlier
are weighted by the ratio of the current policy to the one that generated them; without it the
stale samples slow learning markedly on this fast-moving task.
Steps/s counts the training loop only (Ray start-up and model loading excluded) from the
per-step times in metrics.jsonl. With ``--repeats N`` it runs N pairs, alternating which mode
goes first, and reports the median of the pairs' ratios (the host's speed drifts between runs;
both runs of a pair see about the same host). The last line is the summary a script can read:

    async speedup 1.52x (colocate 6.1 steps/s, async 9.3 steps/s; final reward 0.96 vs 0.95)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spec_text(base: str, model_dir: Path, job_dir: Path, steps: int, mode: str, staleness: int,
              tis_cap: float | None) -> str:
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
    return text


def run_mode(base: str, model_dir: Path, root: Path, steps: int, mode: str, staleness: int,
             tis_cap: float | None = None, run: int = 0) -> tuple[float, float]:
    from relax_hpc.driver.run import run_job
    from relax_hpc.ops.metrics import read_metrics
    from relax_hpc.spec import parse_spec

    job_dir = root / f"{mode}-{run}"  # a fresh job dir per run: nothing to resume
    spec = parse_spec(spec_text(base, model_dir, job_dir, steps, mode, staleness, tis_cap), f"<bench {mode}>")
    run_job(spec, progress=False)
    rows = read_metrics(job_dir / "metrics.jsonl")
    # Skip the first steps: they include actor/engine warm-up.
    warm = rows[min(5, len(rows) - 1):]
    steps_per_s = len(warm) / sum(r["time/step_s"] for r in warm)
    final = sum(r["reward/mean"] for r in rows[-10:]) / min(10, len(rows))
    return steps_per_s, final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "jobspecs" / "tiny_local.toml"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--tis-cap", type=float, default=2.0,
                        help="truncated importance sampling cap in async mode (corrects for stale samples)")
    parser.add_argument("--quick", action="store_true", help="60 steps: timing only, rewards not converged")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pairs of runs (the mode that goes first alternates); the median ratio is reported")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: needs at least 1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    steps = 60 if args.quick else args.steps
    from relax_hpc.models.tiny import write_tiny_model

    base = Path(args.spec).read_text()
    with tempfile.TemporaryDirectory(prefix="relax-bench-async-") as tmp:
        root = Path(tmp)
        model_dir = write_tiny_model(root / "model", seed=1)
        pairs: list[tuple[tuple[float, float], tuple[float, float]]] = []
        for run in range(args.repeats):
            results: dict[str, tuple[float, float]] = {}
            for mode in (("colocate", "async") if run % 2 == 0 else ("async", "colocate")):
                if mode == "colocate":
                    results[mode] = run_mode(base, model_dir, root, steps, "colocate", 0, run=run)
                    label = "colocate"
                else:
                    results[mode] = run_mode(base, model_dir, root, steps, "async", args.max_staleness,
                                             args.tis_cap, run=run)
                    label = f"async (max_staleness {args.max_staleness})"
                print(f"{label}: {results[mode][0]:.2f} steps/s, final reward {results[mode][1]:.3f}", flush=True)
            pairs.append((results["colocate"], results["async"]))
    ratios = [a[0] / c[0] for c, a in pairs]
    colocate = (statistics.median(c[0] for c, _ in pairs), statistics.median(c[1] for c, _ in pairs))
    fully_async = (statistics.median(a[0] for _, a in pairs), statistics.median(a[1] for _, a in pairs))
    spread = f"; median of {len(pairs)} pairs: {' '.join(f'{r:.2f}' for r in ratios)}" if len(pairs) > 1 else ""
    print(f"async speedup {statistics.median(ratios):.2f}x (colocate {colocate[0]:.2f} steps/s, "
          f"async {fully_async[0]:.2f} steps/s; final reward {colocate[1]:.2f} vs {fully_async[1]:.2f}{spread})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
