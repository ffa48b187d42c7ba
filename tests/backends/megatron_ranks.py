"""Run a check script's ranks as spawned processes joined on one free port (Megatron env's python).

    results = run_ranks("megatron_logits_check", 2, run_rank, lambda rank, port, results: (rank, port, results))

Each rank gets the arguments ``make_args(rank, port, results)`` builds; the script exits with the
ranks' exit codes when any failed or none put a result, their tracebacks printed above.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any


def run_ranks(name: str, count: int, target: Callable[..., None],
              make_args: Callable[[int, int, Any], tuple[Any, ...]]) -> Any:
    """The results queue once all ``count`` ranks of ``target`` exited cleanly."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=target, args=make_args(rank, port, results)) for rank in range(count)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    codes = [process.exitcode for process in ranks]
    if any(codes) or results.empty():
        sys.exit(f"{name}: ranks exited with {codes}; their tracebacks are above")
    return results
