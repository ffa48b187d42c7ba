"""The Slurm subcommands of `relax-hpc`: render, submit, status, logs, cancel, convert, grow, shrink.

`status` also reads a local run's job directory (JOBDIR/status.json and the heartbeats:
relax_hpc/ops/run_status.py), and with `--watch` refreshes until Ctrl-C.

Each handler takes the parsed arguments and returns an exit status; relax_hpc/cli/main.py
registers them. The Slurm client is built by :func:`make_client` and a job's REST API by
:func:`make_api`, so tests can swap both.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from relax_hpc.jobspecs.spec_args import add_spec_arguments, load_spec_args
from relax_hpc.launch.federation import (
    DRAIN_TIMEOUT_S,
    ElasticApi,
    FederationError,
    GrowRequest,
    federation_lines,
    grow_request,
    render_grow_sbatch,
    submit_grow,
)
from relax_hpc.launch.jobs import (
    JOB_ID_FILE,
    SUBMIT_SPEC,
    dry_run,
    find_job,
    job_status,
    submit_spec,
)
from relax_hpc.launch.render import render_sbatch
from relax_hpc.launch.slurm_client import SlurmClient, SubprocessSlurmClient
from relax_hpc.ops.run_status import status_lines
from relax_hpc.spec import load_spec
from relax_hpc.spec.slurm_values import SLURM_TIME_FORMATS, slurm_time_to_seconds

__all__ = ["cmd_cancel", "cmd_convert", "cmd_grow", "cmd_logs", "cmd_render", "cmd_shrink", "cmd_status",
           "cmd_submit", "make_api", "make_client", "watch"]

SHRINK_WAIT_MARGIN_S = 60.0  # shrink waits for the drain's own timeout plus this
WATCH_EVERY_S = 5.0  # `relax-hpc status --watch` without --every
FOLLOW_LINES = 50  # `relax-hpc logs -f` without -n
CONVERT_TIME_MIN = 30  # `relax-hpc convert --slurm` without --time
CLEAR_SCREEN = "\033[H\033[2J"


def make_client() -> SlurmClient:
    return SubprocessSlurmClient()


def make_api(job_dir: Path, job: str) -> ElasticApi:
    """The REST API of the job in ``job_dir`` (cluster.json's rest_url; FederationError without one)."""
    return ElasticApi.for_job(job_dir, job)


_GROW_FLAGS = ("engines", "nodes", "partition", "qos", "time", "account", "cpus_per_node", "gpus_per_node")


def cmd_render(args: argparse.Namespace) -> int:
    if args.grow is not None:
        if args.spec or args.overrides:
            given = " ".join(args.spec + [f"--set {o}" for o in args.overrides])
            raise ValueError(f"pass either SPEC ({given}) or --grow JOB, not both")
        print(render_grow_sbatch(_grow_request(args, args.grow, make_client())), end="")
        return 0
    if not args.spec:
        raise ValueError("pass a SPEC to render the job's script, or --grow JOB --engines N for a grow job's")
    given = [f"--{name.replace('_', '-')}" for name in _GROW_FLAGS if getattr(args, name) is not None]
    if given or args.preemptible:
        raise ValueError(f"{', '.join(given) or '--preemptible'} only go with --grow JOB")
    spec = load_spec_args(args).spec
    job_dir = args.job_dir or str(spec.job_dir())
    print(render_sbatch(spec, job_dir, str(Path(job_dir) / SUBMIT_SPEC)), end="")
    return 0


def _grow_request(args: argparse.Namespace, job: str, client: SlurmClient) -> GrowRequest:
    if args.engines is None:
        raise ValueError("--grow JOB needs --engines N: how many engines the grow job starts")
    job_id, job_dir = find_job(job, client)
    if job_dir is None:
        raise FileNotFoundError(f"no job directory found for job {job_id} under ./runs; pass the job directory instead")
    spec_file = job_dir / SUBMIT_SPEC
    if not spec_file.is_file():
        raise FileNotFoundError(f"{spec_file} does not exist: only a job started by `relax-hpc submit` can grow")
    return grow_request(job_dir, job_id, load_spec(spec_file), engines=args.engines, nodes=args.nodes or 1,
                        partition=args.partition, qos=args.qos, time_limit=args.time, account=args.account,
                        cpus_per_node=args.cpus_per_node, gpus_per_node=args.gpus_per_node,
                        preemptible=args.preemptible)


@contextmanager
def _rest_errors() -> Iterator[None]:
    """A REST API that does not answer (RestUnavailable, a ConnectionError) as a one-line error."""
    try:
        yield
    except ConnectionError as e:
        raise FederationError(str(e)) from None


def cmd_grow(args: argparse.Namespace) -> int:
    client = make_client()
    request = _grow_request(args, args.job, client)
    job_id, job_dir = request.main_job_id, Path(request.job_dir)
    states = [c.state for c in client.job_components(job_id)]
    if not states or not states[0].startswith("RUNNING"):
        raise FederationError(f"job {job_id} is {states[0] if states else 'no longer in the queue'}: a grow job "
                              f"joins a running job (`relax-hpc status {job_id}`)")
    with _rest_errors():
        make_api(job_dir, job_id).engines()  # its engines register through the REST API: it must answer now
    grow_id = submit_grow(request, client, Path.cwd())
    where = ", ".join(f"{k} {v}" for k, v in (("partition", request.partition), ("qos", request.qos)) if v)
    print(f"submitted grow job {grow_id}: {request.engines} engine(s) on {request.nodes} node(s) for job {job_id}"
          + (f" ({where}{', preemptible' if request.preemptible else ''})" if where else ""))
    print(f"  relax-hpc status {job_id}                # the grow jobs and every engine")
    print(f"  relax-hpc shrink {job_id} --grow-job {grow_id}   # drain its engines, then end it")
    print(f"  its log: {job_dir}/logs/grow-{grow_id}.out and grow-{grow_id}-node-*.log")
    return 0


def cmd_shrink(args: argparse.Namespace) -> int:
    job_id, job_dir = _job(args)
    if job_dir is None:
        raise FileNotFoundError(f"no job directory found for job {job_id} under ./runs; pass the job directory instead")
    if args.grow_job is not None and not args.grow_job.isdigit():
        raise ValueError(f"--grow-job {args.grow_job!r}: expected the grow job's Slurm id (digits), as "
                         f"`relax-hpc status {job_id}` lists it")
    body: dict[str, object] = {"job": args.grow_job} if args.grow_job is not None else {"num_engines": args.engines}
    if args.force:
        body["force"] = True
    if args.timeout_s is not None:
        body["timeout_s"] = args.timeout_s
    with _rest_errors():
        api = make_api(job_dir, job_id)
        count = args.engines or sum(1 for e in api.engines() if e.get("job") == args.grow_job
                                    and e.get("state") in ("joining", "active"))
        op = api.start("scale_in", body)
        print(f"operation {op.get('id')} (scale_in): draining {count} engine(s) ...", flush=True)
        # Engines drain one after the other, each for up to timeout_s.
        limit = (args.timeout_s or DRAIN_TIMEOUT_S) * max(count, 1) + SHRINK_WAIT_MARGIN_S
        op = api.wait(str(op.get("id")), limit_s=limit)
    print(f"operation {op.get('id')} (scale_in) {op.get('state')}: {op.get('message')}")
    if args.grow_job is not None:
        make_client().cancel(args.grow_job)  # its nodes go back; its engines left already
        print(f"cancelled grow job {args.grow_job}")
    return 0 if op.get("state") == "done" else 1


def cmd_submit(args: argparse.Namespace) -> int:
    composed = load_spec_args(args)
    spec, source = composed.spec, Path(composed.label)
    if args.dry_run:  # Slurm's answer for the rendered script; nothing written, nothing submitted
        print(dry_run(spec, source, make_client(), check_cluster=not args.no_preflight))
        print("dry run: nothing was submitted or written (`relax-hpc render SPEC` prints the script)")
        return 0
    # The job runs spec.submit.toml, written from ``spec``: the overrides are in it.
    done = submit_spec(spec, source, make_client(), check_cluster=not args.no_preflight,
                       original_text=composed.original_text())
    print(f"submitted job {done.job_id}: {spec.job.name}, job dir {done.job_dir}")
    print(f"  relax-hpc status {done.job_id}      # Slurm state of each component, step, reward")
    print(f"  relax-hpc logs {done.job_id} -f     # follow the driver log")
    print(f"  relax-hpc cancel {done.job_id}")
    return 0


def _job(args: argparse.Namespace) -> tuple[str, Path | None]:
    return find_job(args.job, make_client())


def cmd_status(args: argparse.Namespace) -> int:
    if not args.watch:
        print("\n".join(_status_lines(args.job)))
        return 0
    if not args.every > 0:
        raise ValueError(f"--every {args.every:g}: pass the seconds between refreshes, > 0 (default {WATCH_EVERY_S:g})")
    return watch(lambda: _status_lines(args.job), args.every, f"relax-hpc status {args.job}")


def _status_lines(job: str) -> list[str]:
    """A local run's directory (no slurm_job_id in it): its status alone. A Slurm job: each
    component's Slurm state, grow jobs and engines, then the run's status when its directory is known."""
    path = Path(job)
    if path.is_dir() and not (path / JOB_ID_FILE).is_file():
        return status_lines(path)
    job_id, job_dir = find_job(job, make_client())
    client = make_client()
    lines = job_status(job_id, job_dir, client).lines()
    if job_dir is not None:  # grow jobs, and the engines when the REST API answers
        lines += federation_lines(job_id, job_dir, client, lambda: make_api(job_dir, job_id))
        lines += status_lines(job_dir)
    return lines


def watch(lines_of: Callable[[], list[str]], every_s: float, title: str) -> int:
    """Print ``lines_of()`` every ``every_s`` seconds until Ctrl-C (exit 0). On a terminal the
    screen is cleared between refreshes; into a file or pipe each refresh starts with a line
    naming the time, so a log of it reads top to bottom."""
    out = sys.stdout
    try:
        while True:
            lines = lines_of()  # before clearing: a slow squeue does not leave a blank screen
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            if out.isatty():
                out.write(f"{CLEAR_SCREEN}{title}  (every {every_s:g}s, Ctrl-C to stop)  {stamp}\n\n")
            else:
                out.write(f"---- {stamp} ----\n")
            out.write("\n".join(lines) + "\n")
            out.flush()
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0


def _latest_log_dir(job_dir: Path) -> Path | None:
    attempts = sorted((job_dir / "logs").glob("restart-*"), key=lambda p: int(p.name.split("-")[1]))
    return attempts[-1] if attempts else None


def cmd_logs(args: argparse.Namespace) -> int:
    job_id, job_dir = _job(args)
    if job_dir is None:
        print(f"relax-hpc logs: no job directory found for job {job_id} under ./runs; pass the job "
              "directory instead", file=sys.stderr)
        return 2
    log_dir = _latest_log_dir(job_dir)
    if log_dir is None:
        print(f"relax-hpc logs: {job_dir}/logs has no restart-N directory yet (job pending?)", file=sys.stderr)
        return 1
    path = log_dir / f"{args.which}.log"
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in log_dir.glob("*.log"))) or "none"
        print(f"relax-hpc logs: {path} does not exist yet; logs there: {found}", file=sys.stderr)
        return 1
    if args.lines is not None and args.lines < 0:
        raise ValueError(f"-n {args.lines}: pass the number of last lines to print, >= 0")
    if args.follow:
        import os

        lines = FOLLOW_LINES if args.lines is None else args.lines
        os.execvp("tail", ["tail", "-n", str(lines), "-F", str(path)])
    print(f"==> {path} <==")
    text = path.read_text(errors="replace")
    if args.lines is not None:
        text = "".join(text.splitlines(keepends=True)[-args.lines:] if args.lines else [])
    print(text, end="")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job_id, _ = _job(args)
    client = make_client()
    if args.requeue:
        # The batch script traps USR1: the driver checkpoints and stops, then the job requeues.
        client.cancel(job_id, signal="USR1", batch_only=True)
        print(f"asked job {job_id} to checkpoint and requeue (USR1 to its batch script)")
    elif args.stop:
        # USR2: the same checkpoint, then the job ends without a requeue.
        client.cancel(job_id, signal="USR2", batch_only=True)
        print(f"asked job {job_id} to checkpoint and end (USR2 to its batch script); "
              "submit the spec again to resume from that checkpoint")
    else:
        client.cancel(job_id)
        print(f"cancelled job {job_id}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from relax_hpc.launch.convert import convert_checkpoint

    time_min = _time_minutes(args)
    if args.time is not None and not args.slurm:
        raise ValueError("--time is the Slurm job's time limit: it goes with --slurm")
    result = convert_checkpoint(Path(args.job_dir), Path(args.out), step=args.step, on_slurm=args.slurm,
                                partition=args.partition, time_min=time_min or CONVERT_TIME_MIN,
                                device=args.device)
    print(result)
    return 0


def _time_minutes(args: argparse.Namespace) -> int | None:
    """convert's --time (Slurm's forms: 30, 00:30:00, 1-00:00) in whole minutes, rounded up; the
    deprecated --time-min N still counts as N minutes."""
    if args.time_min is not None:
        if args.time is not None:
            raise ValueError(f"--time-min {args.time_min} and --time {args.time}: pass only --time")
        print(f"relax-hpc convert: --time-min is deprecated; pass --time {args.time_min} (minutes, or any "
              "Slurm time limit such as 00:30:00)", file=sys.stderr)
        if args.time_min <= 0:
            raise ValueError(f"--time-min {args.time_min}: pass a positive number of minutes")
        return int(args.time_min)
    if args.time is None:
        return None
    try:
        seconds = slurm_time_to_seconds(args.time)
    except ValueError as e:
        raise ValueError(f"--time {args.time}: not a Slurm time limit ({e}); forms: {SLURM_TIME_FORMATS}") from None
    return -(-seconds // 60)


def _add_grow_options(p: argparse.ArgumentParser, engines_required: bool) -> None:
    p.add_argument("--engines", type=int, required=engines_required, default=None,
                   help="engines the grow job starts, spread over its nodes")
    p.add_argument("--nodes", type=int, default=None, help="nodes of the grow job (default 1)")
    p.add_argument("--partition", default=None, help="default: the rollout component's (with its QOS)")
    p.add_argument("--qos", default=None, help="default: the rollout component's, unless --partition is given")
    p.add_argument("--time", default=None,
                   help="the grow job's time limit in Slurm's forms (90 minutes, 02:00:00, 1-00:00; default: the "
                        "rollout component's)")
    p.add_argument("--account", default=None, help="default: the rollout component's")
    p.add_argument("--cpus-per-node", type=int, default=None, help="default: the rollout component's")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="default: the rollout component's; engines share them round-robin")
    p.add_argument("--preemptible", action="store_true",
                   help="the named --partition/--qos pre-empts jobs: marks the grow job so in status")


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the Slurm subcommands on the `relax-hpc` parser."""
    p = sub.add_parser("render", help="print the sbatch script of a spec, or of a grow job (no side effects)")
    add_spec_arguments(p, optional=True, help="the job spec, as for `run` (or --grow JOB instead)")
    p.add_argument("--job-dir", default=None, metavar="JOBDIR",
                   help="job directory to render for (default: the spec's)")
    p.add_argument("--grow", default=None, metavar="JOB",
                   help="print the script `relax-hpc grow JOB` would submit (with --engines N ...)")
    _add_grow_options(p, engines_required=False)
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("submit", help="submit a spec as one heterogeneous Slurm job")
    add_spec_arguments(p)
    p.add_argument("--no-preflight", action="store_true", help="skip the checks against sinfo")
    p.add_argument("--dry-run", action="store_true",
                   help="check the spec as a submission would, then ask Slurm (sbatch --test-only) when and on "
                        "which nodes the rendered job would start, and print its answer; submits nothing and "
                        "writes nothing, not even the job directory")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="a run's state, step, reward, samples/s, roles' heartbeats, engines, "
                                      "checkpoint and restarts; for a Slurm job also each component's state",
                       description="Print a run's live status. JOB is a job directory (a `relax-hpc run` "
                                   "on this machine, or a submitted job's) or a Slurm job id. A local run "
                                   "shows JOBDIR/status.json joined with the roles' heartbeat files "
                                   "(JOBDIR/health/), the newest checkpoint and whether the driver lives; "
                                   "a Slurm job first shows each component's Slurm state, its grow jobs "
                                   "and engines. docs/operations.md, \"Status\".")
    p.add_argument("job", metavar="JOB", help="job directory (local run or submitted job) or Slurm job id")
    p.add_argument("--watch", action="store_true",
                   help="refresh until Ctrl-C; on a terminal the screen is cleared between refreshes, "
                        "otherwise each starts with a time line")
    p.add_argument("--every", type=float, default=WATCH_EVERY_S, metavar="SECONDS",
                   help=f"seconds between refreshes of --watch (default {WATCH_EVERY_S:g})")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="print (or follow) a log of the job's latest attempt")
    p.add_argument("job", metavar="JOB", help="Slurm job id or job directory")
    p.add_argument("--which", default="driver", choices=["driver", "batch"], help="which log (default driver)")
    p.add_argument("-n", "--lines", type=int, default=None, metavar="N",
                   help=f"only the last N lines (default: the whole log; with -f, the last {FOLLOW_LINES})")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing what is appended, across the log being replaced (tail -F), until Ctrl-C")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("cancel", help="cancel a job (or --requeue: checkpoint and requeue it; --stop: "
                                      "checkpoint and end it)")
    p.add_argument("job", metavar="JOB", help="Slurm job id or job directory")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--requeue", "--checkpoint", dest="requeue", action="store_true",
                     help="instead of cancelling: checkpoint the step in progress, then put the job back in the "
                          "queue, where it resumes from that checkpoint when it starts again (USR1 to its batch "
                          "script; --checkpoint is the old name)")
    how.add_argument("--stop", action="store_true",
                     help="send USR2 to the batch script instead: checkpoint the step in progress, then end the "
                          "job without a requeue (submitting the spec again resumes from that checkpoint)")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("grow", help="add rollout engines to a running job, as a separate Slurm job "
                                    "(docs/federation.md)")
    p.add_argument("job", metavar="JOB", help="the running job's Slurm id or job directory")
    _add_grow_options(p, engines_required=True)
    p.set_defaults(func=cmd_grow)

    p = sub.add_parser("shrink", help="remove rollout engines from a running job: --engines N, or a grow job's")
    p.add_argument("job", metavar="JOB", help="the running job's Slurm id or job directory")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--engines", type=int, default=None, help="drain this many engines (the newest first)")
    which.add_argument("--grow-job", "--job", dest="grow_job", default=None, metavar="GROWJOB",
                       help="drain every engine of this grow job (its Slurm id), then scancel it (--job is the "
                            "old name)")
    p.add_argument("--force", action="store_true", help="the job's own engines may go too (they are protected)")
    p.add_argument("--timeout-s", type=float, default=None, metavar="S",
                   help=f"how long each engine may finish its prompts before they go to others (default {DRAIN_TIMEOUT_S})")
    p.set_defaults(func=cmd_shrink)

    p = sub.add_parser("convert", help="export a DCP checkpoint to a Hugging Face model directory")
    p.add_argument("job_dir", metavar="JOBDIR", help="the job directory whose checkpoints/ to read")
    p.add_argument("out", metavar="OUT", help="the Hugging Face model directory to write")
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step, as in metrics.jsonl and `relax-hpc status` (default: the latest)")
    p.add_argument("--slurm", action="store_true", help="run as a Slurm job through submitit")
    p.add_argument("--partition", default=None, help="the Slurm partition of --slurm (default: Slurm's default)")
    p.add_argument("--time", default=None,
                   help=f"time limit of the --slurm job in Slurm's forms (30 minutes, 00:30:00, 1-00:00; default "
                        f"{CONVERT_TIME_MIN} minutes)")
    p.add_argument("--time-min", type=int, default=None, metavar="MINUTES",
                   help="deprecated: --time MINUTES says the same")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where a megatron backend checkpoint's model is built for the conversion (default cpu; "
                        "cuda with Transformer Engine for mixture-of-experts models)")
    p.set_defaults(func=cmd_convert)
