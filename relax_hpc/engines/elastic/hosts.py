"""Which hosts a job sends its engine token to: the check behind `scale_out` with engine URLs.

Registering an engine by URL makes the rollout role call that URL with the job's engine bearer
token (`RemoteEngineClient` asks `/health` first). Whoever holds the REST token could otherwise
point it at a host of their own and collect the engine token. So a URL is accepted only when
its host resolves to addresses of

* the job's own nodes (its Ray nodes, this machine, loopback), or
* the nodes of one of the job's own grow jobs: the body's ``"job"`` must be a grow job recorded
  in ``JOBDIR/federation/grow_jobs.json`` for this job (`relax-hpc grow` records it when it
  submits, before the grow job runs and registers), and its nodes are what Slurm reports for it.

Anything else is refused with a 400 that says what is accepted. What this does not cover: a
process of another user on one of those nodes (a shared node) that a REST token holder names
(docs/security.md, "What is not covered").

It sits in the engines layer because the rollout role runs it, so it reads the two records
(formats defined in relax_hpc/launch/federation.py) and asks Slurm (`squeue`, `scontrol`) itself
rather than through the launch layer; tests inject `grow_job_nodes` and `node_addresses`.

    policy = EngineHostPolicy(job_dir, own_addresses=ray_node_addresses)
    problem = policy.check(["http://10.0.0.7:30001"], "4243")   # None, or the refusal's message
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["EngineHostPolicy", "expand_hostlist", "local_addresses", "ray_node_addresses", "resolve_host",
           "squeue_job_nodes"]

log = logging.getLogger(__name__)

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
MAX_HOSTLIST_NAMES = 65_536  # a node list longer than any cluster: refused, not expanded
SLURM_QUERY_TIMEOUT_S = 30
GROW_JOBS_RECORD = Path("federation") / "grow_jobs.json"  # launch/federation.py writes both records
CLUSTER_RECORD = Path("cluster.json")


def expand_hostlist(nodes: str) -> list[str]:
    """Slurm's compressed node list as names: "n[01-03,7],gpu5" -> n01 n02 n03 n7 gpu5 (pure)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodes):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(nodes[start:i])
            start = i + 1
    items.append(nodes[start:])
    names: list[str] = []
    for item in (i.strip() for i in items):
        names.extend(_expand_one(item) if item else [])
        if len(names) > MAX_HOSTLIST_NAMES:
            raise ValueError(f"node list {nodes[:80]!r} names more than {MAX_HOSTLIST_NAMES} nodes")
    return names


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end():]
    out = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"node list item {item!r}: {part!r} is not a number or a range")
        width = len(low)
        if high and int(high) - int(low) > MAX_HOSTLIST_NAMES:
            raise ValueError(f"node list item {item!r} names more than {MAX_HOSTLIST_NAMES} nodes")
        for n in range(int(low), int(high or low) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}"))
    return out


def resolve_host(host: str) -> set[str]:
    """Every address `host` resolves to (an address itself: that address); empty when none."""
    try:
        return {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def local_addresses() -> set[str]:
    """This machine's addresses by its host name (the rollout role's node)."""
    found = resolve_host(socket.gethostname())
    try:
        found |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return found


def ray_node_addresses() -> set[str]:
    """The addresses of the job's live Ray nodes and of this machine (no Ray: this machine only)."""
    found = local_addresses()
    try:
        import ray

        if ray.is_initialized():
            found |= {str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 - without Ray's list the job's other nodes are refused, never accepted
        log.warning("could not list the job's Ray nodes; engine URLs on other nodes need a grow job", exc_info=True)
    return found


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _slurm_node_addresses(node: str) -> set[str]:
    """A Slurm node's addresses: its name's and its NodeAddr's (as the grow job's engines use)."""
    addresses = resolve_host(node)
    try:
        shown = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                               timeout=SLURM_QUERY_TIMEOUT_S, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return addresses
    for item in shown.split():
        if item.startswith("NodeAddr="):
            addresses |= resolve_host(item.removeprefix("NodeAddr="))
    return addresses


def squeue_job_nodes(job: str) -> tuple[list[str], str]:
    """(the node names grow job `job` runs on now, its states when that is none, or why Slurm
    could not say): `squeue -h -j JOB -o "%T %N"`, one line per component."""
    try:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %N"], capture_output=True, text=True,
                              timeout=SLURM_QUERY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"squeue could not say where grow job {job} runs ({e}); retry"
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        first = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        return [], f"squeue could not say where grow job {job} runs ({first}); retry"
    nodes: list[str] = []
    states: set[str] = set()
    for line in done.stdout.splitlines():
        state, _, names = line.strip().partition(" ")
        states.add(state)
        if state == "RUNNING":
            nodes.extend(_expand(names.strip()))
    return nodes, "" if nodes else f"grow job {job} runs on no node now ({', '.join(sorted(states)) or 'not in the queue'})"


def _read_record(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s is not readable as JSON (%s): its grow jobs are not accepted", path, e)
        return None


class EngineHostPolicy:
    """The check `ElasticScaler(check_hosts=policy.check)` runs on scale-out URLs (module docstring).

    `own_addresses`: the job's own nodes' addresses (`ray_node_addresses`); `grow_job_nodes`: a
    grow job's running nodes, or why none (`squeue_job_nodes`); `node_addresses`: a Slurm node
    name to its addresses; `resolve`: a URL host to its addresses. Tests inject the last three."""

    def __init__(self, job_dir: Path | None, own_addresses: Callable[[], set[str]] = ray_node_addresses,
                 grow_job_nodes: Callable[[str], tuple[list[str], str]] = squeue_job_nodes,
                 node_addresses: Callable[[str], set[str]] = _slurm_node_addresses,
                 resolve: Callable[[str], set[str]] = resolve_host) -> None:
        self.job_dir = None if job_dir is None else Path(job_dir)
        self._own, self._grow_job_nodes = own_addresses, grow_job_nodes
        self._node_addresses, self._resolve = node_addresses, resolve

    def check(self, urls: list[str], job: str | None) -> str | None:
        """None when every URL's host is accepted; else the 400's message."""
        own: set[str] | None = None
        grow: tuple[set[str], str] | None = None
        refused: list[str] = []
        for url in urls:
            try:
                host = urlsplit(url).hostname
            except ValueError:
                host = None
            addresses = self._resolve(host) if host else set()
            if not addresses:
                refused.append(f"{url} (its host does not resolve)")
                continue
            if all(_is_loopback(a) for a in addresses):
                continue
            own = self._own() if own is None else own
            if addresses <= own:
                continue
            if job is not None:
                grow = self._grow_job_addresses(job) if grow is None else grow
                if addresses <= grow[0]:
                    continue
            refused.append(f"{url} ({host} is {', '.join(sorted(addresses))})")
        if not refused:
            return None
        why = (grow[1] if grow is not None and grow[1] else
               'no "job" was given' if job is None else f"its hosts are not grow job {job}'s nodes")
        return (f"scale_out refused {', '.join(refused)}: the job sends its engine token to the engines it "
                "registers, so it accepts engine URLs only on its own nodes or on the nodes of one of its grow "
                'jobs, named by "job" (a grow job recorded in JOBDIR/federation/grow_jobs.json and running; '
                f"`relax-hpc grow` submits and records them); {why}. Start the engines with `relax-hpc grow`, "
                "or serve them on one of the job's nodes")

    def _grow_job_addresses(self, job: str) -> tuple[set[str], str]:
        """(the addresses of grow job `job`'s nodes, why there are none: "" when there are)."""
        if job not in self._recorded_grow_jobs():
            where = self.job_dir / "federation" / "grow_jobs.json" if self.job_dir else "the job directory"
            return set(), f"job {job} is not one of this job's grow jobs ({where} does not list it)"
        nodes, why = self._grow_job_nodes(job)
        if not nodes:
            return set(), why
        addresses: set[str] = set()
        for node in nodes:
            addresses |= self._node_addresses(node)
        return addresses, f"they are not grow job {job}'s nodes ({', '.join(nodes[:8])})"

    def _recorded_grow_jobs(self) -> set[str]:
        """The grow jobs JOBDIR/federation/grow_jobs.json records for this job (cluster.json's
        job id; every record when the job directory has no cluster.json)."""
        if self.job_dir is None:
            return set()
        content = _read_record(self.job_dir / GROW_JOBS_RECORD)
        records = content.get("grow_jobs", []) if isinstance(content, dict) else []
        cluster = _read_record(self.job_dir / CLUSTER_RECORD)
        cluster = cluster if isinstance(cluster, dict) else {}
        main = str(cluster["job_id"]) if cluster.get("job_id") is not None else None
        return {str(r.get("job_id")) for r in records if isinstance(r, dict)
                and r.get("job_id") is not None and (main is None or str(r.get("main_job_id")) == main)}


def _expand(nodes: str) -> Iterable[str]:
    try:
        return expand_hostlist(nodes)
    except ValueError as e:
        log.warning("%s", e)
        return []
