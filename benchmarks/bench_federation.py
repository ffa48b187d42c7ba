"""Samples/s of a running job before and after a grow job adds rollout engines, on the local Slurm.

    tools/dev-slurm up                       # a local 3-node Slurm (docs/dev-slurm.md)
    python benchmarks/bench_federation.py [--engines 2] [--window 15] [--max-new-tokens 4]

It submits jobspecs/tiny_slurm.toml (trainer and rollout, one node each, one engine) with the
trajectory archive on, measures samples/s over `--window` steps, runs `relax-hpc grow JOB
--engines N` (a third node), waits until those engines serve, measures the same window again,
then cancels the grow job in the middle of a step and lets the main job finish. Both windows
are read from the job's own metrics.jsonl (samples per step / step time), so both figures come
from the same run on the same host. It also measures what the host can give at most: how much
faster two single-threaded torch processes run than one (the local Slurm's "nodes" are one
host). The last lines are what a script reads:

    host: 2 CPUs, two torch processes run 1.02x as fast as one (the most that extra engines ...)
    samples/s: 1 engine 512.3, +2 engines 734.0 (1.43x)
    exactly-once: 51200 samples, 0 duplicated, 0 lost

`--max-new-tokens` makes generation a larger share of a step (the tiny task answers in 4 tokens,
so its steps are mostly training); more engines speed up generation only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RELAX_HPC = [sys.executable, "-m", "relax_hpc.cli.main"]


def slurm_env() -> dict[str, str]:
    state = Path(os.environ.get("RELAX_DEV_SLURM_DIR", "/tmp/relax-dev-slurm"))
    conf = state / "slurm.conf"
    if not conf.is_file():
        sys.exit(f"no local Slurm at {state}: start one with tools/dev-slurm up")
    return {**os.environ, "SLURM_CONF": str(conf), "RAY_AUTH_MODE": "disabled"}


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([*RELAX_HPC, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    if done.returncode not in (0, 1) or (done.returncode == 1 and "--check-exactly-once" not in args):
        sys.exit(f"relax-hpc {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout


def metrics(job_dir: Path) -> list[dict[str, Any]]:
    path = job_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(what: str, check: Any, timeout: float = 600.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(1.0)
    return found


def samples_per_s(rows: list[dict[str, Any]], samples_per_step: int) -> float:
    return samples_per_step * len(rows) / sum(r["time/step_s"] for r in rows)


def engines(job_dir: Path) -> list[dict[str, Any]]:
    from relax_hpc.auth import JobSecret
    from relax_hpc.engines.elastic.rest_api import RestClient, RestUnavailable

    info = json.loads((job_dir / "cluster.json").read_text()) if (job_dir / "cluster.json").is_file() else {}
    if not info.get("rest_url"):
        return []
    try:
        status, body = RestClient(info["rest_url"], JobSecret.load(job_dir / ".secret").token("rest")).get(
            "/rollout/engines")
    except RestUnavailable:
        return []
    return body.get("engines", []) if status == 200 else []


PROBE = """
import time, torch
torch.set_num_threads(1)
a = torch.randn(384, 384)
start = time.perf_counter()
for _ in range(400):
    a = torch.tanh(a @ a)
print(time.perf_counter() - start)
"""


def host_parallel_speedup() -> float:
    """How much faster two single-threaded torch processes finish than the same work run twice in
    a row: what extra engines on this host can add at most (1.0: nothing; the "nodes" of the
    local Slurm are one host, and 2 vCPUs may be one core's two hyperthreads)."""
    def run(n: int) -> float:
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.DEVNULL) for _ in range(n)]
        for proc in procs:
            proc.wait()
        return time.perf_counter() - start
    return 2 * run(1) / run(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2, help="engines of the grow job (default 2)")
    parser.add_argument("--window", type=int, default=15, help="steps measured before and after (default 15)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="[rollout] max_new_tokens (default 4)")
    parser.add_argument("--chunks-per-engine", type=int, default=1,
                        help="[rollout] chunks_per_engine (default 1: alike engines, one batch pass each)")
    args = parser.parse_args()
    env = slurm_env()
    from relax_hpc.models.tiny import write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-federation-"))
    model = write_tiny_model(root / "model", seed=1)
    steps = 8 * args.window + 60  # room for the grow job to start and join between the windows
    text = (REPO / "jobspecs" / "tiny_slurm.toml").read_text()
    text = text.replace('name = "tiny_slurm"', f'name = "bench_grow"\noutput_dir = "{root / "job"}"')
    text = text.replace('path = "runs/models/tiny-qwen3"', f'path = "{model}"')
    text = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", text)
    text = re.sub(r"(?m)^max_new_tokens = \d+", f"max_new_tokens = {args.max_new_tokens}", text)
    text = re.sub(r"(?m)^n_samples_per_prompt = (\d+)", rf"n_samples_per_prompt = \1\nchunks_per_engine = {args.chunks_per_engine}",
                  text)
    text += "\n[metrics]\ntrajectory_archive = true\n"
    spec = root / "bench_grow.toml"
    spec.write_text(text)
    prompts = int(re.search(r"(?m)^prompts_per_step = (\d+)", text).group(1))  # type: ignore[union-attr]
    group = int(re.search(r"(?m)^n_samples_per_prompt = (\d+)", text).group(1))  # type: ignore[union-attr]
    per_step = prompts * group
    job_dir = root / "job"

    job_id = re.search(r"submitted job (\d+)", cli(env, "submit", str(spec))).group(1)  # type: ignore[union-attr]
    print(f"job {job_id}: {steps} steps, job dir {job_dir}", flush=True)
    warm = 5
    before = wait_for("the first window", lambda: len(metrics(job_dir)) >= warm + args.window and metrics(job_dir))
    before = metrics(job_dir)[-args.window:]  # the steps just before the grow: the same phase of training
    out = cli(env, "grow", job_id, "--engines", str(args.engines))
    grow_id = re.search(r"submitted grow job (\d+)", out).group(1)  # type: ignore[union-attr]
    print(f"grow job {grow_id}: {args.engines} engines", flush=True)

    def grown() -> bool:
        mine = [e for e in engines(job_dir) if e["job"] == grow_id and e["state"] == "active"]
        return len(mine) == args.engines
    wait_for("the grow job's engines to join", grown)
    joined_at = metrics(job_dir)[-1]["step"]
    after = wait_for("the second window", lambda: [r for r in metrics(job_dir) if r["step"] > joined_at + 2]
                     if len([r for r in metrics(job_dir) if r["step"] > joined_at + 2]) >= args.window else None)
    after = after[: args.window]
    if after[-1]["step"] >= steps - 2:
        sys.exit("the job ended before the second window was measured; raise --window")
    engines_seen = statistics.mean(r["rollout/engines"] for r in after)
    subprocess.run(["scancel", grow_id], env=env, check=True)  # mid-step: its engines hold prompts
    print(f"cancelled grow job {grow_id} at step {metrics(job_dir)[-1]['step']}", flush=True)
    wait_for("the main job to finish", lambda: (job_dir / "summary.json").is_file(), timeout=1800)
    check = cli(env, "inspect", str(job_dir), "--check-exactly-once").strip().splitlines()[-1]
    first, second = samples_per_s(before, per_step), samples_per_s(after, per_step)
    print(f"max_new_tokens {args.max_new_tokens}, chunks_per_engine {args.chunks_per_engine}")
    print(f"windows: steps {before[0]['step']}-{before[-1]['step']} with 1 engine, "
          f"{after[0]['step']}-{after[-1]['step']} with {engines_seen:.0f} engines")
    print(f"host: {os.cpu_count()} CPUs, two torch processes run {host_parallel_speedup():.2f}x as fast as one "
          "(the most that extra engines on this host can add)")
    gen_before, gen_after = (statistics.mean(r["time/generate_s"] for r in w) for w in (before, after))
    print(f"generation: {gen_before:.3f} s -> {gen_after:.3f} s per step ({gen_before / gen_after:.2f}x); the rest "
          f"of a step (training) {statistics.mean(r['time/step_s'] for r in before) - gen_before:.3f} s")
    print(f"samples/s: 1 engine {first:.1f}, +{args.engines} engines {second:.1f} ({second / first:.2f}x)")
    print(check)


if __name__ == "__main__":
    main()
