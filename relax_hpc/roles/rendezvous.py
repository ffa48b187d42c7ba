"""The address a process group's TCP store listens on, picked on the node that hosts rank 0.

A module of its own, importing neither torch nor the roles: `place_ranks` (roles/placement.py)
runs `node_and_rendezvous` as a Ray task on a node of the group's component, and the worker
process that runs it imports only this module. Ray does not hand that worker to the actors
started after it, so it stays idle until the job ends: it should cost an interpreter, not a torch
import (about 2 CPU-seconds).
"""

from __future__ import annotations

import socket

__all__ = ["node_and_rendezvous", "rendezvous_address"]


def rendezvous_address() -> str:
    """host:port on this node for the trainer group's TCP store (rank 0 calls it on its own node)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:  # not under Ray: a single machine
        host = "127.0.0.1"
    return f"{host}:{port}"


def node_and_rendezvous() -> tuple[str, str]:
    """This Ray node's id and a `rendezvous_address()` on it (run as a task on the group's node)."""
    import ray

    return ray.get_runtime_context().get_node_id(), rendezvous_address()
