"""How long `relax-hpc --help` takes against a bare interpreter, measured in one run.

    python benchmarks/cli_startup.py [--repeats 5] [--command "validate tiny_local"]

Each command starts a fresh interpreter (this one, `sys.executable`) as a user's shell would:
`python -m relax_hpc.cli.main --help` (what the `relax-hpc` script runs) and `python -c pass`.
Each is run --repeats times, alternating the two, and the best wall time of each counts (the
host's other work only ever adds time). The last line is the summary a script can read:

    relax-hpc --help 0.281 s, python -c pass 0.021 s (best of 5 each): 13.4x a bare interpreter

With ``--command`` another relax-hpc command line is timed in place of `--help` (e.g.
"validate tiny_local"); docs/benchmarks.md, "CLI start-up", has the figures.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def wall_s(argv: list[str]) -> float:
    """Seconds from start to exit of one run of ``argv``; its output is discarded, its failure raises."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command; the best counts (default 5)")
    parser.add_argument("--command", default="--help",
                        help="the relax-hpc arguments to time (default --help)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: pass at least 1")
    cli = [sys.executable, "-m", "relax_hpc.cli.main", *shlex.split(args.command)]
    bare = [sys.executable, "-c", "pass"]
    wall_s(cli)  # once untimed: the first run after an install also writes the .pyc files
    times: dict[str, list[float]] = {"cli": [], "bare": []}
    for _ in range(args.repeats):
        times["cli"].append(wall_s(cli))
        times["bare"].append(wall_s(bare))
    best_cli, best_bare = min(times["cli"]), min(times["bare"])
    for name, runs in times.items():
        print(f"{name:<5} " + " ".join(f"{t:.3f}" for t in runs))
    print(f"relax-hpc {args.command} {best_cli:.3f} s, python -c pass {best_bare:.3f} s "
          f"(best of {args.repeats} each): {best_cli / best_bare:.1f}x a bare interpreter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
