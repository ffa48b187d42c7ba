"""`relax-hpc rehearse SPEC`: run a production spec at its real layout on this machine, with only
what the machine cannot provide replaced, and print every replacement (docs/rehearsal.md).

    relax-hpc rehearse jobspecs/qwen3_omni.toml                 # CPU: 3 steps, resume 1, export
    relax-hpc rehearse jobspecs/qwen3_omni.toml --device cuda   # on a GPU node: only the model shrinks

The rehearsal's directory (--out, default runs/rehearse-<job name>) holds model/ (the tiny model),
data/ (synthetic rows, when the spec's data is not readable here), rehearsal-spec.toml and
resume-spec.toml (what runs), job/ (the job directory both runs share), hf/ (the export) and
one log per stage. Each stage is the command a user runs, as a subprocess: `relax-hpc run` of the
rehearsal spec (--steps steps, then a second run of one more step on the same job directory, as a
requeue resumes), then `relax-hpc convert`. The last line is `rehearsal passed: SPEC (N steps, K
changes)`, or the first failure with its stage and role; the exit status is 0 only on a pass.
relax_hpc/launch/rehearse_spec.py maps the spec (pure); rehearse_build.py writes the inputs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.launch.rehearse_spec import Device, Machine, Rehearsal, format_changes, rehearsal_spec
from relax_hpc.spec import JobSpec, SpecError, parse_spec, spec_to_toml

MARKER = "rehearsal-spec.toml"  # also marks a directory a later rehearsal may replace
RESUME_SPEC = "resume-spec.toml"
DEFAULT_RUN_TIMEOUT_S = 900.0
SYNTHETIC_ROWS = 64
# Where the side environments are when their variable is not set (relative to the working directory).
SGLANG_ENV, MEGATRON_ENV = ("RELAX_SGLANG_ENV", ".venv-sglang"), ("RELAX_MEGATRON_ENV", ".venv-megatron")
# A Ray actor's class in a traceback -> the role it plays.
_ROLE_OF_ACTOR = {"ActorWorker": "trainer", "RolloutWorker": "rollout", "EngineHost": "engine",
                  "ForwardWorker": "forward (actor_fwd / reference)", "AdvantagesWorker": "advantages"}
_ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exhausted)\b|^relax-hpc \w[\w-]*: ")


@dataclass(frozen=True)
class Failure:
    stage: str  # "run", "resume", "export", "build"
    role: str
    line: str
    log: Path | None

    def report(self, spec_path: str) -> str:
        where = f"; log {self.log}" if self.log else ""
        return f"rehearsal failed: {spec_path} at {self.stage} (role {self.role}): {self.line}{where}"


def side_python(variable: str, default_dir: str) -> str | None:
    """The python of a side environment: $variable/bin/python, else default_dir's, if it exists."""
    env_dir = Path(os.environ.get(variable) or default_dir).absolute()
    python = env_dir / "bin" / "python"
    return str(python) if python.is_file() else None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def sglang_python(spec: JobSpec) -> str | None:
    """The SGLang servers' interpreter when the spec names none and this one cannot import sglang."""
    if not spec.rollout.on_sglang or spec.rollout.sglang.python is not None:
        return None
    if _importable("sglang"):
        return None
    found = side_python(*SGLANG_ENV)
    if found is None:
        raise ValueError(f'rollout.engine = "sglang": {sys.executable} cannot import sglang and there is no SGLang '
                         f"environment at ${SGLANG_ENV[0]} or ./{SGLANG_ENV[1]}; build it with tools/setup-sglang-cpu "
                         f"(docs/engines.md, \"SGLang on CPU\") or set {SGLANG_ENV[0]} to one")
    return found


def megatron_python(spec: JobSpec) -> str | None:
    """The interpreter that runs a megatron spec when this one lacks megatron-core or the bridge."""
    if spec.train.backend != "megatron":
        return None
    if all(_importable(name) for name in ("megatron.core", "megatron.bridge")):
        return None
    found = side_python(*MEGATRON_ENV)
    if found is None:
        raise ValueError(f'train.backend = "megatron": {sys.executable} cannot import megatron-core and '
                         f"megatron-bridge and there is no Megatron environment at ${MEGATRON_ENV[0]} or "
                         f"./{MEGATRON_ENV[1]}; build it with tools/setup-megatron-cpu (docs/backends.md, "
                         f"\"Megatron on CPU\") or set {MEGATRON_ENV[0]} to one")
    return found


def find_machine(spec: JobSpec, device: Device, steps: int, work_dir: Path, arch: str | None) -> Machine:
    """What this machine offers the rehearsal of `spec`: read here, handed to the pure mapping."""
    config: dict[str, Any] | None = None
    try:
        config = json.loads((Path(spec.model.path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    data = Path(spec.data.path).expanduser()
    return Machine(device=device, steps=steps, work_dir=work_dir.absolute(), model_config=config,
                   data_readable=data.is_file() and os.access(data, os.R_OK), arch=arch,
                   sglang_python=sglang_python(spec), megatron_python=megatron_python(spec))


def fresh_work_dir(path: Path) -> Path:
    """An empty directory; one an earlier rehearsal left (it holds MARKER) is replaced."""
    if path.exists():
        if not (path / MARKER).is_file():
            raise FileExistsError(f"{path} exists and is not a rehearsal's directory (no {MARKER}); pass another --out")
        shutil.rmtree(path)
    path.mkdir(mode=0o700, parents=True)
    return path


def checked_text(spec: JobSpec, name: str) -> str:
    """The spec as TOML, loaded back once: a mapping the schema refuses shows before any run."""
    text = spec_to_toml(spec)
    try:
        parse_spec(text, name)
    except SpecError as e:
        raise ValueError(f"the rehearsal of this spec is not a valid spec (a change it needs is refused): {e}") from e
    return text


def rehearse(spec: JobSpec, spec_path: str, *, steps: int, device: Device, arch: str | None = None,
             out: Path | None = None, run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
             echo: Callable[[str], None] | None = None) -> int:
    """Map, build, run, resume, export; print the table and the last line. 0 on a pass, 1 otherwise."""
    echo = echo or _print_now
    work = (out or Path("runs") / f"rehearse-{spec.job.name}").absolute()
    rehearsal = rehearsal_spec(spec, find_machine(spec, device, steps, work, arch))
    first = checked_text(rehearsal.spec, MARKER)
    again = dataclasses.replace(rehearsal.spec, train=dataclasses.replace(rehearsal.spec.train, steps=steps + 1))
    resume = checked_text(again, RESUME_SPEC)
    fresh_work_dir(work)  # only once the mapping holds: a refused spec leaves nothing behind
    (work / MARKER).write_text(first)
    (work / RESUME_SPEC).write_text(resume)
    echo(f"rehearsal of {spec_path} in {work}: {len(rehearsal.changes)} changes")
    echo(format_changes(rehearsal.changes))
    failure = _build(rehearsal, spec) or _stages(rehearsal, work, steps, run_timeout_s, echo)
    if failure is not None:
        echo(failure.report(spec_path))
        return 1
    echo(f"rehearsal passed: {spec_path} ({steps} steps, {len(rehearsal.changes)} changes)")
    return 0


def _print_now(line: str) -> None:
    print(line, flush=True)  # each stage's line shows as it starts, also through a pipe


def _build(rehearsal: Rehearsal, spec: JobSpec) -> Failure | None:
    from relax_hpc.launch.rehearse_build import give_positions, write_synthetic_rows, write_tiny_model_of

    r = rehearsal.spec
    try:
        model = write_tiny_model_of(rehearsal.arch, Path(r.model.path), seed=spec.job.seed, on_sglang=r.rollout.on_sglang)
        if rehearsal.positions is not None:
            give_positions(model, rehearsal.positions)
    except Exception as e:  # noqa: BLE001 - reported as the rehearsal's first failure
        return Failure("build", "tiny model", f"{type(e).__name__}: {e}", None)
    if rehearsal.synthetic_kinds is None:
        return None
    try:
        write_synthetic_rows(r.data, r.reward.function, rehearsal.synthetic_kinds, Path(r.data.path),
                             SYNTHETIC_ROWS, spec.job.seed)
    except Exception as e:  # noqa: BLE001
        return Failure("build", "synthetic data", f"{type(e).__name__}: {e}", None)
    return None


def _stages(rehearsal: Rehearsal, work: Path, steps: int, timeout_s: float,
            echo: Callable[[str], None]) -> Failure | None:
    python = rehearsal.runner or sys.executable
    job = Path(str(rehearsal.spec.job.output_dir))
    runs = (("run", MARKER, 0, steps), ("resume", RESUME_SPEC, steps, steps + 1))
    for stage, spec_file, start, end in runs:
        echo(f"{stage}: steps {start + 1}..{end} (log {work / (stage + '.log')})")
        failure = _run_stage(stage, [python, "-m", "relax_hpc.cli.main", "run", str(work / spec_file),
                                     "--no-progress"], work, job, rehearsal.runner is not None, timeout_s, echo)
        failure = failure or _check_summary(stage, job, start, end, work / f"{stage}.log")
        if failure is not None:
            return failure
    echo(f"export: {job / 'checkpoints'} -> {work / 'hf'}")
    failure = _run_stage("export", [python, "-m", "relax_hpc.cli.main", "convert", str(job), str(work / "hf")],
                         work, job, rehearsal.runner is not None, timeout_s, echo)
    if failure is None and not any((work / "hf").glob("*.safetensors")):
        failure = Failure("export", "convert", f"{work / 'hf'} holds no safetensors file", work / "export.log")
    return failure


def _run_stage(stage: str, command: list[str], work: Path, job: Path, other_env: bool, timeout_s: float,
               echo: Callable[[str], None]) -> Failure | None:
    """`command` in a session of its own (every process it starts is ended afterwards)."""
    from relax_hpc.faults.process import JobProcess, MetricsTail

    env = dict(os.environ)
    if other_env:  # another venv's python: nothing of this one's path may leak into it
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(name, None)
    log = work / f"{stage}.log"
    started = time.monotonic()
    process = JobProcess(command, log, env)
    tail = MetricsTail(job / "metrics.jsonl")
    try:
        code = process.wait_exit(tail, started + timeout_s)
    except BaseException:  # Ctrl-C reaches this process only: the stage's session is its own
        process.kill_all()
        raise
    process.finish()
    echo(f"  {stage}: exit {code} after {time.monotonic() - started:.0f} s" if code is not None else
         f"  {stage}: killed after {timeout_s:.0f} s")
    if code is None:
        return Failure(stage, failed_role(log), f"no end after {timeout_s:.0f} s (killed)", log)
    if code != 0:
        return Failure(stage, failed_role(log), f"exit {code}: {error_line(log)}", log)
    return None


def _check_summary(stage: str, job: Path, start: int, end: int, log: Path) -> Failure | None:
    try:
        summary = json.loads((job / "summary.json").read_text())
    except (OSError, ValueError) as e:
        return Failure(stage, "driver", f"no readable summary.json ({e})", log)
    got = (summary.get("start_step"), summary.get("end_step"))
    if got != (start, end):
        return Failure(stage, "driver", f"ran steps {got[0]}..{got[1]}, not {start}..{end}", log)
    return None


def error_line(log: Path, max_chars: int = 300) -> str:
    """The log's last error line (an exception, or `relax-hpc run: ...`), else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    last = (errors or lines or [""])[-1]
    return last if len(last) <= max_chars else last[: max_chars - 3] + "..."


def failed_role(log: Path) -> str:
    """The role the log blames first: a Ray actor in a traceback, a role named dead, else the driver."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "driver"
    found = (re.search(r"RoleDiedError: (.+?) (?:could not start|died|became unreachable)", text)
             or re.search(r"^\(raised by (.+?) while ", text, re.MULTILINE))  # the note roles/supervision.py adds
    if found:
        return found[1]
    error = error_line(log)
    if "rollout producer failed" in error:  # the trainer waited on rows the rollout role could not make
        return "rollout engine" if re.search(r"Engine\w*Error|SGLang", error) else "rollout"
    actor = re.search(r"ray::(\w+)\.", text)
    if actor and actor[1] in _ROLE_OF_ACTOR:
        return _ROLE_OF_ACTOR[actor[1]]
    if "SGLangServerError" in text:
        return "engine (SGLang server)"
    return "driver"
