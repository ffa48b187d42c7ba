"""The Slurm subcommands of `relax-hpc`: render, submit, status, logs, cancel, convert.

Each handler takes the parsed arguments and returns an exit status; relax_hpc/cli/main.py
registers them. The Slurm client is built by :func:`make_client` so tests can swap it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from relax_hpc.launch.jobs import SUBMIT_SPEC, find_job, job_status, submit_spec
from relax_hpc.launch.render import render_sbatch
from relax_hpc.launch.slurm_client import SlurmClient, SubprocessSlurmClient
from relax_hpc.jobspecs import with_embedded_inputs
from relax_hpc.spec import load_spec

__all__ = ["cmd_cancel", "cmd_convert", "cmd_logs", "cmd_render", "cmd_status", "cmd_submit", "make_client"]


def make_client() -> SlurmClient:
    return SubprocessSlurmClient()


def cmd_render(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    job_dir = args.job_dir or str(spec.job_dir())
    print(render_sbatch(spec, job_dir, str(Path(job_dir) / SUBMIT_SPEC)), end="")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    spec = with_embedded_inputs(load_spec(args.spec), args.spec)
    done = submit_spec(spec, Path(args.spec), make_client(), check_cluster=not args.no_preflight)
    print(f"submitted job {done.job_id}: {spec.job.name}, job dir {done.job_dir}")
    print(f"  relax-hpc status {done.job_id}      # Slurm state of each component, step, reward")
    print(f"  relax-hpc logs {done.job_id} -f     # follow the driver log")
    print(f"  relax-hpc cancel {done.job_id}")
    return 0


def _job(args: argparse.Namespace) -> tuple[str, Path | None]:
    return find_job(args.job, make_client())


def cmd_status(args: argparse.Namespace) -> int:
    job_id, job_dir = _job(args)
    for line in job_status(job_id, job_dir, make_client()).lines():
        print(line)
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
    if args.follow:
        import os

        os.execvp("tail", ["tail", "-n", "50", "-F", str(path)])
    print(f"==> {path} <==")
    print(path.read_text(errors="replace"), end="")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job_id, _ = _job(args)
    client = make_client()
    if args.checkpoint:
        # The batch script traps USR1: checkpoint, then (without requeue) end.
        client.cancel(job_id, signal="USR1", batch_only=True)
        print(f"asked job {job_id} to checkpoint and requeue (USR1 to its batch script)")
    else:
        client.cancel(job_id)
        print(f"cancelled job {job_id}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from relax_hpc.launch.convert import convert_checkpoint

    result = convert_checkpoint(Path(args.job_dir), Path(args.out), step=args.step, on_slurm=args.slurm,
                                partition=args.partition, time_min=args.time_min)
    print(result)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the Slurm subcommands on the `relax-hpc` parser."""
    p = sub.add_parser("render", help="print the sbatch script of a spec (no side effects)")
    p.add_argument("spec")
    p.add_argument("--job-dir", default=None, help="job directory to render for (default: the spec's)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("submit", help="submit a spec as one heterogeneous Slurm job")
    p.add_argument("spec")
    p.add_argument("--no-preflight", action="store_true", help="skip the checks against sinfo")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="Slurm state of each component, step, reward, restarts")
    p.add_argument("job", help="Slurm job id or job directory")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="print (or follow) a log of the job's latest attempt")
    p.add_argument("job", help="Slurm job id or job directory")
    p.add_argument("--which", default="driver", choices=["driver", "batch"], help="which log (default driver)")
    p.add_argument("-f", "--follow", action="store_true")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("cancel", help="cancel a job (or --checkpoint: checkpoint and requeue it)")
    p.add_argument("job", help="Slurm job id or job directory")
    p.add_argument("--checkpoint", action="store_true",
                   help="send USR1 to the batch script instead: checkpoint, then requeue")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("convert", help="export a DCP checkpoint to a Hugging Face model directory")
    p.add_argument("job_dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--slurm", action="store_true", help="run as a Slurm job through submitit")
    p.add_argument("--partition", default=None)
    p.add_argument("--time-min", type=int, default=30)
    p.set_defaults(func=cmd_convert)
