"""CPU an idle SGLang server takes, with relax-hpc's CPU flags and without `--sleep-on-idle`.

    python benchmarks/bench_sglang_idle.py [--python .venv-sglang/bin/python] [--seconds 10]

Starts one server on a freshly built tiny Qwen3 with `CPU_FLAGS` (relax_hpc/engines/
sglang/server.py), waits until it answers, and counts the CPU seconds its processes (server,
scheduler, detokenizer) use over `--seconds` of idleness; then the same without `--sleep-on-idle`.
Without it SGLang's scheduler polls its sockets in a loop: a whole core per server, for as long as
the server lives, taken from whatever else runs on the node (on CPU: the trainer). The last line:

    idle SGLang server, CPU seconds per second: 0.03 with --sleep-on-idle, 1.02 without (34x)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from relax_hpc.engines.sglang.server import CPU_FLAGS, SGLangServer  # noqa: E402
from relax_hpc.models.tiny import write_tiny_model  # noqa: E402

SLEEP_FLAG = "--sleep-on-idle"


def cpu_seconds_of_tree(pid: int) -> float:
    """User + system CPU seconds of `pid` and every process under it (from /proc)."""
    listing = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in listing.splitlines():
        child, parent = (int(x) for x in line.split())
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    total = 0
    for p in tree:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(python: str, model: Path, log: Path, seconds: float, sleep_on_idle: bool) -> float:
    """CPU seconds per second of one idle server."""
    import relax_hpc.engines.sglang.server as server_module

    flags = CPU_FLAGS if sleep_on_idle else tuple(f for f in CPU_FLAGS if f != SLEEP_FLAG)
    saved, server_module.CPU_FLAGS = server_module.CPU_FLAGS, flags
    try:
        with SGLangServer(python, model, log_path=log) as server:
            assert server.pid is not None
            time.sleep(3)  # past the first requests of its start-up
            before = cpu_seconds_of_tree(server.pid)
            time.sleep(seconds)
            return (cpu_seconds_of_tree(server.pid) - before) / seconds
    finally:
        server_module.CPU_FLAGS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=str(REPO / ".venv-sglang" / "bin" / "python"))
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if SLEEP_FLAG not in CPU_FLAGS:
        sys.exit(f"{SLEEP_FLAG} is not among CPU_FLAGS any more: nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", seed=1)
        sleeping = idle_cpu(args.python, model, Path(tmp) / "sleep.log", args.seconds, True)
        polling = idle_cpu(args.python, model, Path(tmp) / "poll.log", args.seconds, False)
    print(f"idle SGLang server, CPU seconds per second: {sleeping:.2f} with {SLEEP_FLAG}, {polling:.2f} without "
          f"({polling / max(sleeping, 1e-3):.0f}x)")


if __name__ == "__main__":
    main()
