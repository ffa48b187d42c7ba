"""The `relax-hpc` command line.

    relax-hpc run SPEC          train on this machine (local Ray cluster); resumes from checkpoints
    relax-hpc validate SPEC     check a spec; exit 0, or print every problem and exit 2
    relax-hpc show SPEC         print the fully resolved spec (every default filled in)
    relax-hpc make-tiny DIR     write the tiny Qwen3-architecture model + tokenizer (--kind vl|omni:
                                a tiny Qwen2.5/3-VL or Qwen2.5/3-Omni with processor configs)
    relax-hpc plot JOBDIR       (re)draw JOBDIR/reward_curve.png and plots.png from JOBDIR/metrics.jsonl
    relax-hpc inspect JOBDIR    per-step summaries (and example samples) of the trajectory archive;
                                --check-exactly-once: was every planned sample trained once?
    relax-hpc serve-engine DIR  serve a model over HTTP (SGLang's /generate subset); prints the URL
    relax-hpc render SPEC       print the heterogeneous sbatch script of a spec (no side effects)
    relax-hpc submit SPEC       submit it to Slurm (--dry-run: ask Slurm when and where it would start, submit
                                nothing); status | logs | cancel JOB; convert JOBDIR OUT
    relax-hpc status JOB        a run's state, step, reward, samples/s, roles' health, restarts (--watch)
    relax-hpc grow JOB          add rollout engines to a running job from another Slurm job (render --grow
                                shows its script); shrink JOB drains engines away (docs/federation.md)
    relax-hpc rehearse SPEC     run a production spec at its real layout with a tiny model of its architecture:
                                steps, resume, export, and a table of every change (--device cuda on a GPU node)
    relax-hpc faults SPEC       run SPEC once per fault (killed roles, driver, hung role, corrupt checkpoint,
                                full disk) and check each run recovered, every sample trained once

SPEC is a TOML file, or the name of a spec shipped in the package (tiny_local, tiny_slurm),
so an installed wheel runs `relax-hpc run tiny_local` from any directory (relax_hpc/jobspecs/).
run, validate, show, render, submit and rehearse take several, merged left to right, and
--set KEY=VALUE on top (relax_hpc/jobspecs/spec_args.py; docs/spec.md, "Several files and --set overrides").
JOB is a Slurm job id or a job directory, JOBDIR a job directory. `relax-hpc --version` prints
the installed version. Commands that need no tensors import neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Callable

from relax_hpc.cli import slurm_commands
from relax_hpc.jobspecs import resolve_spec_path, with_embedded_inputs
from relax_hpc.jobspecs.spec_args import add_spec_arguments, load_spec_args
from relax_hpc.launch.federation import SlurmGrowSubmitter
from relax_hpc.launch.slurm_client import SlurmError
from relax_hpc.models.mm_archs import TINY_MM_ARCHS, is_omni
from relax_hpc.spec import JobSpec, SpecError, load_spec, spec_to_toml
from relax_hpc.spec.compose import annotate_origins
from relax_hpc.spec.model_fit import memory_report

EXIT_BAD_INPUT = 2
# One name per kind of positional, whichever command takes it, so usage lines and help agree:
# a spec is SPEC, a Slurm job id or job directory is JOB, a job directory alone is JOBDIR.
POSITIONAL_NAMES = {"spec": "SPEC", "job": "JOB", "job_dir": "JOBDIR"}


def _cmd_validate(args: argparse.Namespace) -> int:
    from relax_hpc.driver.alerts import notify_urls
    from relax_hpc.driver.spec_checks import check_spec_runs
    from relax_hpc.ops.notify import redact_url

    composed = load_spec_args(args)
    spec, source = composed.spec, composed.label
    checked = check_spec_runs(spec, source)  # SpecError / ValueError: exit 2
    shape, media = checked.shape, checked.media
    image_lines = []
    if args.image is not None:  # ValueError listing what the image lacks: exit 2
        from relax_hpc.launch.image_check import check_image

        image_lines = check_image(spec, Path(args.image), source)
    print(f"{source}: ok (job '{spec.job.name}', {spec.train.steps} steps, "
          f"algorithm {spec.algorithm.name}, mode {spec.job.mode})")
    for line in image_lines:
        print(line)
    for line in media.lines:
        print(line)
    urls = notify_urls(spec)
    if urls:
        print(f"notify: Apprise accepts {', '.join(redact_url(url) for url in urls)}")
    if shape is None:
        arch = f" (its kind was checked from [model] arch = {spec.model.arch!r})" if spec.model.arch else ""
        print(f"model {spec.model.path}: no config.json readable here, so the checks that need it are skipped "
              f"until the job runs{arch}: its sizes against the parallel layout and its bytes per GPU against "
              "gpu_memory_gb (validate where the model is to run them now)")
    else:
        for line in memory_report(spec):
            print(line)
    return 0


def _count(number: float) -> str:
    return f"{number / 1e9:.2f} B" if number >= 1e9 else f"{number / 1e6:.2f} M"


def _cmd_show(args: argparse.Namespace) -> int:
    # An embedded spec shows its data path in the package: the output runs from anywhere.
    # Each value given in a file or by --set is followed by where: "# base.toml:12", "# --set".
    composed = load_spec_args(args)
    print(annotate_origins(spec_to_toml(composed.spec), composed.origins), end="")
    return 0


def _grow_submitter(spec: JobSpec, ray_address: str | None) -> SlurmGrowSubmitter | None:
    """Inside a submitted job (the batch script's driver) with [federation] on: its grow jobs go to Slurm."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if spec.federation.max_engines <= 0 or not ray_address or not job_id:
        return None
    return SlurmGrowSubmitter(spec.job_dir(), job_id, spec, slurm_commands.make_client())


def _cmd_run(args: argparse.Namespace) -> int:
    from relax_hpc.driver.run import run_job

    spec = load_spec_args(args).spec
    if args.start_over:  # this run only: the next one resumes from what this one saves
        spec = dataclasses.replace(spec, checkpoint=dataclasses.replace(spec.checkpoint, resume=False))
    report = run_job(spec, in_process=args.in_process, ray_address=args.ray_address,
                     progress=not args.no_progress, grow_submitter=_grow_submitter(spec, args.ray_address))
    print(report.summary_line())
    if report.curve:
        print(f"reward curve: {report.curve}")
    return 0


TINY_DEFAULT_ARCH = {"vl": "qwen2_5_vl", "omni": "qwen3_omni"}


def _tiny_arch(kind: str | None, arch: str | None) -> str | None:
    """The multimodal arch `make-tiny` writes (None: the text model); --arch must match --kind."""
    if arch is None:
        return TINY_DEFAULT_ARCH.get(kind or "text")
    arch_kind = "omni" if is_omni(arch) else "vl"
    if kind not in (None, arch_kind):
        instead = "the tiny text model" if kind == "text" else f"--kind {kind}'s default ({TINY_DEFAULT_ARCH[kind]})"
        raise ValueError(f"--arch {arch} is of --kind {arch_kind}, not {kind}; pass --kind {arch_kind}, "
                         f"or leave --arch out for {instead}")
    return arch


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from relax_hpc.models.tiny import write_tiny_model
    from relax_hpc.models.tiny_mm import write_tiny_multimodal

    arch = _tiny_arch(args.kind, args.arch)
    if arch is None:
        out = write_tiny_model(Path(args.dir), seed=args.seed)
        print(f"wrote the tiny model to {out}")
        return 0
    out = write_tiny_multimodal(Path(args.dir), arch, seed=args.seed)
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        params = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote the tiny {arch} model to {out} ({_count(params)} parameters, {size / 1024:.0f} KiB)")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from relax_hpc.ops.plot import plot_run

    job_dir = Path(args.job_dir)
    metrics = job_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist: give the job directory of a run "
                                "(its [job] output_dir) that has [metrics] jsonl = true")
    drawn = plot_run(metrics, job_dir, job_dir.name)
    missing = [name for name, recorded in drawn.recorded.items() if not recorded]
    print(f"wrote {drawn.reward_curve} and {drawn.panels_png}"
          + (f" (not recorded in this run: {', '.join(missing)})" if missing else ""))
    return 0


def _archive_decoder(job_dir: Path) -> Callable[[list[int]], str] | None:
    """The job's tokenizer (model path of JOBDIR/spec.toml) as a decoder, or None if not loadable."""
    try:
        from relax_hpc.models.hf import load_tokenizer

        tokenizer = load_tokenizer(load_spec(job_dir / "spec.toml").model.path)
    except Exception as e:  # inspecting must work without the model: fall back to token ids
        print(f"relax-hpc inspect: showing token ids, the job's tokenizer is not loadable ({e})",
              file=sys.stderr)
        return None
    return lambda ids: str(tokenizer.decode(ids))


def _cmd_inspect(args: argparse.Namespace) -> int:
    from relax_hpc.ops.archive import inspect_report

    job_dir = Path(args.job_dir)
    if not job_dir.is_dir():
        raise FileNotFoundError(f"no job directory {job_dir}; pass the job's output_dir (e.g. runs/<name>)")
    if args.check_exactly_once:
        return _inspect_exactly_once(job_dir, args)
    if args.samples < 0:
        raise ValueError(f"--samples {args.samples}: pass a count >= 0")
    decode = _archive_decoder(job_dir) if args.samples > 0 else None
    print(inspect_report(job_dir, args.step, args.samples, decode))
    return 0


def _inspect_exactly_once(job_dir: Path, args: argparse.Namespace) -> int:
    """Exit 0 when no sample was duplicated or lost, 1 otherwise (2, via main, on no archive)."""
    from relax_hpc.ops.exactly_once import check_exactly_once

    if args.step is not None or args.samples:
        raise ValueError("--check-exactly-once checks every archived step: drop --step and --samples")
    report = check_exactly_once(job_dir)
    print(report.format(max_problems=20))
    return 0 if report.ok else 1


def _serve_engine_token() -> tuple[str, str]:
    """The server's bearer token and where it comes from: the job's, when RELAX_HPC_SECRET_FILE
    names a job secret, else a fresh one for this run."""
    import os  # here, like the other imports of the commands: `relax-hpc validate` starts fast

    from relax_hpc.auth import SECRET_ENV, JobSecret
    from relax_hpc.engines.http.auth import ENGINE_TOKEN_PURPOSE, engine_token

    if os.environ.get(SECRET_ENV):
        return engine_token(), f"the job's, from {SECRET_ENV}"
    return JobSecret.generate().token(ENGINE_TOKEN_PURPOSE), "new for this run"


def _cmd_serve_engine(args: argparse.Namespace) -> int:
    import signal

    from relax_hpc.engines.http.auth import default_token_file, write_token_file
    from relax_hpc.engines.http.server import (
        EngineServer,
        ServerLimits,
        exposure_warning,
    )
    from relax_hpc.engines.native import NativeEngine

    chosen = {"request_timeout_s": args.request_timeout_s, "max_connections": args.max_connections,
              "max_untrusted_per_peer": args.max_untrusted_per_peer, "max_body_bytes": args.max_body_bytes, "max_prompts": args.max_prompts,
              "max_request_prompt_tokens": args.max_prompt_tokens,
              "max_request_new_tokens": args.max_new_tokens}
    limits = ServerLimits(**{k: v for k, v in chosen.items() if v is not None})  # the rest: its defaults
    token, origin = _serve_engine_token()
    engine = NativeEngine(args.model_dir, dtype=args.dtype, device=args.device)
    info = {"model_path": str(args.model_dir), "tokenizer_path": str(args.model_dir),
            "model_type": str(getattr(engine.model.config, "model_type", ""))}
    try:
        server = EngineServer(engine, token=token, host=args.host, port=args.port, model_info=info,
                              vocab_size=int(engine.model.config.vocab_size), limits=limits,
                              weights_root=args.weights_root)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); "
                         "pick another --port, or --port 0 for a free one") from e
    token_file = Path(args.token_file) if args.token_file else default_token_file(server.port)
    try:
        token_file = write_token_file(token_file, token)
    except OSError as e:
        server.stop()
        raise ValueError(f"cannot write the token file {token_file} ({e.strerror}); pass --token-file PATH "
                         "in a directory of yours") from e
    warning = exposure_warning(args.host, server.port)
    if warning:
        print(f"relax-hpc serve-engine: {warning}", file=sys.stderr, flush=True)
    print(f"relax-hpc serve-engine: bearer token ({origin}) in {token_file} (mode 0600, removed at exit); "
          "clients send 'Authorization: Bearer <its contents>'", file=sys.stderr, flush=True)
    print(server.url, flush=True)  # the first line of output: scripts read it to find a free port
    previous = signal.signal(signal.SIGTERM, _interrupt)  # kill and scancel end it like Ctrl-C
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        token_file.unlink(missing_ok=True)
    return 0


def _cmd_faults(args: argparse.Namespace) -> int:
    """Exit 0 when every fault that ran was recovered, 1 otherwise (2, via main, on a bad spec)."""
    from relax_hpc.faults.fault import FAULTS, default_out, fault_named, suite_ok
    from relax_hpc.faults.suite import run_suite

    spec = with_embedded_inputs(load_spec(args.spec), args.spec)
    faults = [fault_named(name) for name in dict.fromkeys(args.only)] if args.only else list(FAULTS)
    out = Path(args.out) if args.out else default_out(spec)
    rows = run_suite(spec, out, faults, args.steps, args.run_timeout_s, in_one_run=args.in_one_run)
    return 0 if suite_ok(rows) else 1


def _add_faults_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from relax_hpc.faults.fault import (
        DEFAULT_STEPS,
        DEFAULT_TIMEOUT_S,
        FAULTS,
        MIN_STEPS,
    )

    listing = "\n".join(f"  {f.name:<20}{f.what}" for f in FAULTS)
    p = sub.add_parser(
        "faults", help="run SPEC once per injected fault and check every run recovered, each sample trained once",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run SPEC (a few steps) once per fault, inject the fault mid-run, and check the run "
                    "recovered: it exited 0 at its last step, and the exactly-once check of its trajectory "
                    "archive found no sample duplicated or lost. Prints a table (fault, recovered, restart "
                    "kind, time to recover, samples trained, duplicated, lost) and 'faults survived: K/N, "
                    "samples lost L, duplicated D'; exit 0 only when every fault that ran was recovered. "
                    "docs/operations.md, \"Fault suite\".",
        epilog=f"faults, in the order they run:\n{listing}")
    p.add_argument("spec", help="the job spec (a file, or an embedded spec's name: tiny_local)")
    p.add_argument("--only", nargs="+", metavar="FAULT", choices=[f.name for f in FAULTS], default=None,
                   help="run only these faults (default: all)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"steps of each run (default {DEFAULT_STEPS}, at least {MIN_STEPS}); faults come after step 3")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the job directories go, DIR/<fault>/, and DIR/faults.json "
                        "(default runs/faults-<job name>); an earlier suite's directories there are replaced")
    p.add_argument("--in-one-run", action="store_true",
                   help="inject the faults one after another into one run of SPEC (OUT/in-one-run/), each once "
                        "the run recovered from the one before: one start-up instead of one per fault, and a "
                        "run that survives a sequence of faults; disk-full still gets a run of its own. The "
                        "order is fixed (docs/operations.md, \"Fault suite\"); a fault that breaks the run "
                        "leaves the later ones untried")
    p.add_argument("--run-timeout-s", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"longest one run of the spec may take before it is killed and its fault fails "
                        f"(default {DEFAULT_TIMEOUT_S:.0f}); with --in-one-run, the longest to each fault, and "
                        f"from it to the next fault or the end")
    p.set_defaults(func=_cmd_faults)


def _cmd_rehearse(args: argparse.Namespace) -> int:
    """Exit 0 when the rehearsal passed, 1 when a stage failed (2, via main, on a bad spec)."""
    from relax_hpc.launch.rehearse import rehearse

    composed = load_spec_args(args)
    return rehearse(composed.spec, composed.label, steps=args.steps, device=args.device, arch=args.arch,
                    out=Path(args.out) if args.out else None, run_timeout_s=args.run_timeout_s)


def _add_rehearse_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from relax_hpc.launch.rehearse import DEFAULT_RUN_TIMEOUT_S
    from relax_hpc.launch.rehearse_spec import DEFAULT_STEPS, TINY_ARCHS

    p = sub.add_parser(
        "rehearse", help="run SPEC at its real layout here (tiny model, synthetic data, CPU ranks), print every change",
        description="Run SPEC through the same code path as `relax-hpc run`, with only what this machine cannot "
                    "provide replaced: a tiny model of the same architecture, synthetic rows with the same "
                    "columns when the data is not readable, CPU processes for GPUs at the same layout (as small "
                    "as still runs the same code path). Prints the changes (key, production, rehearsal, why), "
                    "runs --steps steps, resumes one more step in a second run, exports to Hugging Face, and "
                    "ends with 'rehearsal passed: SPEC (N steps, K changes)' or the first failure with its role. "
                    "docs/rehearsal.md.")
    add_spec_arguments(p)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"steps of the first run (default {DEFAULT_STEPS}); the resume run trains one more")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): GPUs become CPU processes; cuda: on a GPU node, nothing is mapped, only "
                        "the model shrinks (the acceptance run before a submit)")
    p.add_argument("--arch", choices=TINY_ARCHS, default=None,
                   help="the architecture of the tiny model (default: the model's config.json, else [model] arch)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="the rehearsal's directory (default runs/rehearse-<job name>); an earlier rehearsal's is "
                        "replaced")
    p.add_argument("--run-timeout-s", type=float, default=DEFAULT_RUN_TIMEOUT_S, metavar="S",
                   help=f"longest one stage may take before it is killed (default {DEFAULT_RUN_TIMEOUT_S:.0f})")
    p.set_defaults(func=_cmd_rehearse)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def package_version() -> str:
    """The installed distribution's version; a checkout that was never installed has only the module's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("relax-hpc")
    except PackageNotFoundError:
        from relax_hpc import __version__

        return __version__


class _VersionAction(argparse.Action):
    """`--version`: looks the version up only when asked, so building the parser stays instant."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"relax-hpc {package_version()}")
        parser.exit()


def _name_positionals(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Give every command's positionals their kind's name (POSITIONAL_NAMES)."""
    for command in sub.choices.values():
        for action in command._actions:
            if not action.option_strings and action.dest in POSITIONAL_NAMES:
                action.metavar = POSITIONAL_NAMES[action.dest]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relax-hpc",
        description="Asynchronous, agentic RL post-training for LLMs, packaged for Slurm clusters.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print relax-hpc's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="train a job spec on this machine (resumes from its checkpoints)")
    add_spec_arguments(p)
    p.add_argument("--in-process", action="store_true",
                   help="run every role in this process instead of Ray actors (debugging)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="join an existing Ray cluster (default: start a local one)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--start-over", action="store_true",
                   help="train from step 0 although JOBDIR/checkpoints has checkpoints (this run only, like "
                        "[checkpoint] resume = false): without it a run whose checkpoints all fail to load "
                        "stops with an error instead; the old checkpoints are not deleted, newer ones are kept")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("validate", help="check a job spec; exit 2 with every problem listed")
    add_spec_arguments(p)
    p.add_argument("--image", default=None, metavar="ROOT",
                   help="also check that the image whose root file system is ROOT (apptainer build --sandbox, "
                        "tools/build-image-root; / inside the image) has everything the spec needs "
                        "(docs/containers.md)")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("show", help="print the fully resolved job spec, each given value followed by where "
                                    "it came from (# FILE:LINE, # --set)")
    add_spec_arguments(p)
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("make-tiny", help="write a tiny Qwen3-architecture model + tokenizer to DIR "
                                         "(--kind vl|omni: a tiny multimodal one)")
    p.add_argument("dir", metavar="DIR", help="the directory to write (must not exist yet)")
    p.add_argument("--kind", choices=("text", "vl", "omni"), default=None,
                   help="text: the tiny Qwen3 text model (default, unless --arch says otherwise); vl: a vision-language model "
                        f"(default --arch {TINY_DEFAULT_ARCH['vl']}); omni: the full omni model, audio "
                        f"and vision in, text out (default --arch {TINY_DEFAULT_ARCH['omni']})")
    p.add_argument("--arch", choices=TINY_MM_ARCHS, default=None,
                   help="the multimodal architecture; must be one of --kind's")
    p.add_argument("--seed", type=int, default=1, help="initialisation seed (default 1)")
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("plot", help="draw JOBDIR/reward_curve.png and JOBDIR/plots.png (reward, losses, KL, "
                                    "entropy, response length, step time, samples/s) from JOBDIR/metrics.jsonl")
    p.add_argument("job_dir", help="the job directory (the spec's [job] output_dir, e.g. runs/tiny_local)")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("inspect", help="summarise JOBDIR's trajectory archive per step; --samples K shows examples; "
                                       "--check-exactly-once checks no sample was trained twice or lost")
    p.add_argument("job_dir", help="the job directory whose trajectories/ to read")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="only step N, counted from 1 as in metrics.jsonl and `relax-hpc status`")
    p.add_argument("--samples", type=int, default=0, metavar="K",
                   help="also print K example samples of --step (default: the last step), decoded "
                        "with the job's tokenizer when it loads")
    p.add_argument("--check-exactly-once", action="store_true",
                   help="check that every sample the spec plans was trained exactly once (sample ids, "
                        "group sizes, missing steps); prints the problems and 'exactly-once: N samples, "
                        "D duplicated, L lost'; exit 0 when D and L are 0, 1 otherwise, 2 without an archive")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("serve-engine", help="serve MODEL_DIR over HTTP (POST /generate, GET /health); prints the URL")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for all, with a warning: plain HTTP "
                        "shows the bearer token to anyone watching the network)")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="where to write the bearer token clients must send, mode 0600 (default "
                        "~/.relax-hpc/engine-<host>-<port>.token); the token is the job's when "
                        "RELAX_HPC_SECRET_FILE is set, else new for this run")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed at start)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the weights' dtype on the device (default float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)")
    p.add_argument("--weights-root", default=None, metavar="DIR",
                   help="take new weights by POST /update_weights_from_disk from directories under DIR (the "
                        "training job writes each version to DIR/v<N>); without it the weights never change")
    # The limits' defaults live in ServerLimits (engines/http/server.py) and docs/engines.md.
    p.add_argument("--request-timeout-s", type=float, default=None,
                   help="seconds a request may take to arrive, headers and body; idle connections close after it")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections; the next one is answered 503 (clients retry a 503 within their timeout)")
    p.add_argument("--max-untrusted-per-peer", type=int, default=None,
                   help="connections one address may hold before showing the bearer token; a new one past "
                        "this closes that address's oldest")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body; larger ones get 413 unread")
    p.add_argument("--max-prompts", type=int, default=None, help="prompts in one /generate")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt token ids in one /generate, all its prompts together")
    p.add_argument("--max-new-tokens", type=int, default=None, help="largest sampling_params.max_new_tokens")
    p.set_defaults(func=_cmd_serve_engine)

    slurm_commands.add_parsers(sub)  # render, submit, status, logs, cancel, convert, grow, shrink
    _add_faults_parser(sub)
    _add_rehearse_parser(sub)
    _name_positionals(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if isinstance(getattr(args, "spec", None), str):
        args.spec = resolve_spec_path(args.spec)
    try:
        return int(args.func(args))
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"relax-hpc {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SlurmError as e:
        print(f"relax-hpc {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
