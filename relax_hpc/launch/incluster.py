"""Helpers the rendered batch script runs inside the allocation (one process per call).

    python -m relax_hpc.launch.incluster head-address --job-id J --node NODE
    python -m relax_hpc.launch.incluster node --job-id J --first-slot K --component rollout ...
    python -m relax_hpc.launch.incluster wait --address HOST:PORT --nodes N --timeout S --pid P ...

``node`` runs on every node through ``srun`` (one task per node): it derives this node's
ports and temp dir from the job id and its slot (``--first-slot`` + ``SLURM_NODEID``), checks
the ports are free, and replaces itself with ``ray start --block``. ``wait`` runs in the batch
shell: it waits until every node has joined the Ray cluster, failing fast when one of the
given ``srun`` PIDs has exited, then writes ``cluster.json`` (mode 0600). Exit status 0 means
success; anything else comes with one line on stderr saying what failed and where to look.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from relax_hpc.auth import SECRET_ENV
from relax_hpc.ops.ports import PORT_SLOT_ENV, RayPorts, ray_ports, ray_temp_dir
from relax_hpc.ops.ray_node_env import apply_ray_node_env

__all__ = ["claim_private_dir", "main", "node_address", "ray_start_command", "write_cluster_json"]

EXIT_FAILED = 1


def node_address(node: str) -> str:
    """The IP address of Slurm node ``node`` (its NodeAddr, resolved); the name itself as fallback."""
    address = node
    try:
        shown = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                               timeout=30, check=False).stdout
        for item in shown.split():
            if item.startswith("NodeAddr="):
                address = item.removeprefix("NodeAddr=")
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return socket.gethostbyname(address)
    except OSError:
        return address


def ray_start_command(ray: str, ports: RayPorts, temp_dir: str, ip: str, *, head_address: str | None,
                      num_cpus: int, num_gpus: int, resources: dict[str, float]) -> list[str]:
    """The ``ray start --block`` command line of one node (pure)."""
    cmd = [
        ray, "start", "--block", "--disable-usage-stats", f"--temp-dir={temp_dir}",
        # Every driver of the job connects with log_to_driver=False: nothing reads what a log
        # monitor would publish, and it costs each node about a CPU-second to start.
        "--include-log-monitor=false",
        f"--node-ip-address={ip}", f"--node-manager-port={ports.node_manager}",
        f"--object-manager-port={ports.object_manager}",
        f"--dashboard-agent-listen-port={ports.dashboard_agent_listen}",
        f"--dashboard-agent-grpc-port={ports.dashboard_agent_grpc}",
        f"--metrics-export-port={ports.metrics_export}", f"--runtime-env-agent-port={ports.runtime_env_agent}",
        f"--min-worker-port={ports.min_worker}", f"--max-worker-port={ports.max_worker}",
        f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
        f"--resources={json.dumps(resources, sort_keys=True)}",
    ]
    if head_address is None:
        cmd += ["--head", f"--port={ports.gcs}", f"--ray-client-server-port={ports.ray_client_server}",
                f"--dashboard-port={ports.dashboard}", "--include-dashboard=false"]
    else:
        cmd += [f"--address={head_address}"]
    return cmd


def _busy_ports(ip: str, ports: Sequence[int]) -> list[int]:
    busy = []
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((ip, port))
            except OSError:
                busy.append(port)
    return busy


def _ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.is_file() else (shutil.which("ray") or "ray")


def _cmd_head_address(args: argparse.Namespace) -> int:
    print(f"{node_address(args.node)}:{ray_ports(args.job_id, 0).gcs}")
    return 0


def _cmd_node(args: argparse.Namespace) -> int:
    slot = args.first_slot + int(os.environ.get("SLURM_NODEID", "0"))
    ports = ray_ports(args.job_id, slot)
    temp_dir = ray_temp_dir(args.job_id, slot)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    ip = node_address(node)
    problem = claim_private_dir(Path(temp_dir))
    if problem:
        print(f"relax-hpc node: {args.component} node {node} (slot {slot}) of job {args.job_id} cannot start "
              f"Ray: {problem}", file=sys.stderr)
        return EXIT_FAILED
    busy = _busy_ports(ip, ports.all_ports())
    if busy:
        print(f"relax-hpc node: {args.component} node {node} (slot {slot}) of job {args.job_id} cannot start "
              f"Ray: ports {busy[:8]} on {ip} are in use (another job or process); see docs/slurm.md "
              "'Ports'", file=sys.stderr)
        return EXIT_FAILED
    # A colocated component's roles find these nodes by its resource too (same amount).
    resources = {name: float(args.resource) for name in [args.component, *args.also_resource]}
    head = None if args.head else args.address
    cmd = ray_start_command(_ray_executable(), ports, temp_dir, ip, head_address=head,
                            num_cpus=args.num_cpus, num_gpus=args.num_gpus, resources=resources)
    print(f"relax-hpc node: {args.component} slot {slot} on {node} ({ip}): {' '.join(cmd)}", flush=True)
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # the job script sets it, and the token's path
    os.environ[PORT_SLOT_ENV] = f"{args.job_id}:{slot}"  # Ray's workers: the engines' planned ports
    apply_ray_node_env(os.environ)
    return _run_until_stopped(cmd, temp_dir)


def claim_private_dir(path: Path) -> str | None:
    """Create ``path`` 0700, or accept it when it is already ours and closed to others; else
    the problem, in words.

    Ray keeps its sockets and session files in its temp dir: one another user created first
    (the name is predictable from the job id) or can write into would let them redirect or
    read the job's Ray traffic.
    """
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create its temp dir {path} ({exc.strerror})"
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        return f"its temp dir {path} exists and is not a directory; remove it"
    if st.st_uid != os.getuid():
        return (f"its temp dir {path} exists and belongs to uid {st.st_uid}, not to you: someone may be "
                "trying to take over this job's Ray; ask the admins, or resubmit (a new job id, a new path)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)  # ours: close it before Ray writes anything into it
    return None


def _run_until_stopped(cmd: list[str], temp_dir: str) -> int:
    """Run ``ray start --block``, passing SIGTERM/SIGINT on; say so when Ray ends by itself.

    The batch script removes the job's temp dirs once every srun has stopped (Slurm ends a
    cancelled step too quickly for a clean-up here).
    """
    child = subprocess.Popen(cmd)
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    if stopping:
        return 0
    print(f"relax-hpc node: ray exited with status {code} without being asked to; its logs are in "
          f"{temp_dir}/session_latest/logs", file=sys.stderr)
    return code or EXIT_FAILED


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def write_cluster_json(path: Path, content: dict[str, object]) -> None:
    """Write ``content`` as JSON readable by the owner only (0600), via a temp file and rename."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(content, out, indent=2)
    os.chmod(tmp, 0o600)  # an existing tmp file keeps its old mode through O_CREAT
    tmp.replace(path)


def _alive_nodes(address: str, deadline: float, pids: Sequence[int], expected: int) -> int:
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        while True:
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
            if alive >= expected:
                return alive
            dead = [pid for pid in pids if not _pid_alive(pid)]
            if dead:
                raise RuntimeError(f"an srun that starts Ray nodes exited early (PID {dead}); "
                                   f"{alive} of {expected} nodes joined. See the ray-*.log files in "
                                   "this restart's log directory")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {alive} of {expected} Ray nodes joined within the timeout "
                                   "(cluster.ray_join_timeout_s); see the ray-*.log files in this "
                                   "restart's log directory")
            time.sleep(1.0)
    finally:
        ray.shutdown()


def _wait_for_head(address: str, deadline: float, pids: Sequence[int]) -> None:
    host, _, port = address.rpartition(":")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError:
            pass
        dead = [pid for pid in pids if not _pid_alive(pid)]
        if dead:
            # `pids` are every srun that starts a Ray node: the one that died may be a worker's.
            raise RuntimeError(f"an srun that starts Ray nodes exited early (PID {dead}), before the Ray head "
                               f"at {address} accepted connections; see the ray-*.log files in this restart's "
                               "log directory")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head at {address} did not accept connections within the "
                               "timeout (cluster.ray_join_timeout_s)")
        time.sleep(0.5)


def _cmd_wait(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    try:
        _wait_for_head(args.address, deadline, args.pid)
        alive = _alive_nodes(args.address, deadline, args.pid, args.nodes)
    except RuntimeError as error:
        print(f"relax-hpc wait: {error}", file=sys.stderr)
        return EXIT_FAILED
    if args.cluster_json:
        content: dict[str, object] = {
            "job_id": args.job_id, "head_address": args.address, "nodes": alive,
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "rest_url": None,  # filled in once the REST API exists
            # Clients authenticate with tokens derived from this file (docs/security.md).
            "secret_file": os.environ.get(SECRET_ENV), "written_at": time.time(),
        }
        write_cluster_json(Path(args.cluster_json), content)
    print(f"relax-hpc wait: {alive} Ray nodes joined at {args.address}", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m relax_hpc.launch.incluster")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("head-address", help="print HOST:PORT of the Ray head of this job")
    p.add_argument("--job-id", type=int, required=True)
    p.add_argument("--node", required=True, help="Slurm name of the head node")
    p.set_defaults(func=_cmd_head_address)
    p = sub.add_parser("node", help="start this node's Ray process (run through srun)")
    p.add_argument("--job-id", type=int, required=True)
    p.add_argument("--first-slot", type=int, required=True, help="slot of this step's node 0")
    p.add_argument("--component", required=True, choices=["trainer", "rollout", "forward"])
    p.add_argument("--resource", type=float, default=1.0, help="amount of the component resource")
    p.add_argument("--also-resource", action="append", default=[], choices=["trainer", "rollout", "forward"],
                   help="advertise this component's resource too (its roles run here: [cluster] colocate)")
    p.add_argument("--num-cpus", type=int, required=True)
    p.add_argument("--num-gpus", type=int, default=0)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--head", action="store_true")
    group.add_argument("--address", help="HOST:PORT of the head")
    p.set_defaults(func=_cmd_node)
    p = sub.add_parser("wait", help="wait until every node joined; write cluster.json")
    p.add_argument("--address", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--pid", type=int, action="append", default=[], help="srun PIDs to watch")
    p.add_argument("--job-id", type=int, default=0)
    p.add_argument("--cluster-json", default=None)
    p.set_defaults(func=_cmd_wait)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
