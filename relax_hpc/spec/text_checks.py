"""Checks of the spec strings that reach the sbatch script or a command line.

Nothing from the spec becomes shell. The launch layer writes some spec strings into the batch
script: the job name, the job directory and the Slurm options into ``#SBATCH`` lines, the
container image, binds and env into the command that runs every step. Each such key has a
check here that says exactly what it may hold, so a newline (which would end the ``#SBATCH``
comment and start a shell line) or any other control character is refused while the spec is
validated, with the key named, before anything is rendered. relax_hpc/launch/render.py refuses
or quotes again (with ``control_character``), as a second line of defence.

Names and paths that never reach a shell (model and data paths, dataset keys, URLs) get
``plain_text`` too: a control character there is always a mistake. Free text (prompt
templates, system prompts, stop strings) is not restricted: a stop string may well be "\\n\\n".

Like every check (relax_hpc/spec/constraints.py), each returns None or a message that finishes
"<key> = <value>: ..." and says what is allowed.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from relax_hpc.spec.constraints import Check
from relax_hpc.spec.errors import show_value

__all__ = [
    "bind_mounts",
    "container_image",
    "control_character",
    "env_assignments",
    "items",
    "job_name",
    "plain_text",
    "sbatch_options",
    "slurm_constraint",
    "slurm_name",
    "slurm_names",
]

# Unicode categories refused: controls (newline, CR, tab, NUL, ESC, DEL, C1), invisible format
# characters (zero-width and bidi overrides, which make text read differently from what runs),
# and the line and paragraph separators that some tools take for line breaks.
_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def control_character(text: str) -> str | None:
    """The first control or invisible character of ``text`` and where it is, or None."""
    for index, char in enumerate(text):
        if unicodedata.category(char) in _CONTROL_CATEGORIES:
            return f"{char!r} at position {index}"
    return None


def plain_text(value: str) -> str | None:
    found = control_character(value)
    if found is None:
        return None
    return f"must not contain control characters (newline, carriage return, tab, NUL, ...); found {found}"


def items(check: Check) -> Check:
    """Apply a string check to every element of a list, naming the first element that fails."""

    def check_each(values: Sequence[str]) -> str | None:
        for index, item in enumerate(values):
            message = check(item)
            if message is not None:
                return f"element {index} ({show_value(item)}) {message}"
        return None

    return check_each


_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def job_name(value: str) -> str | None:
    # "." and ".." match the character set but would make the job directory runs/. or
    # runs/.., i.e. an existing directory shared with other jobs.
    if _JOB_NAME.fullmatch(value) is None or set(value) == {"."}:
        return "must be 1..64 characters from A-Z a-z 0-9 _ . - (and not only dots)"
    return None


_SLURM_NAME = r"[A-Za-z0-9_.-]+"
_ONE_SLURM_NAME = re.compile(_SLURM_NAME)
_SLURM_NAME_LIST = re.compile(rf"{_SLURM_NAME}(?:,{_SLURM_NAME})*")


def slurm_name(value: str) -> str | None:
    """An account or QOS: one Slurm name."""
    if _ONE_SLURM_NAME.fullmatch(value) is None:
        return "must be one Slurm name from A-Z a-z 0-9 _ . -"
    return None


def slurm_names(value: str) -> str | None:
    """A partition: one Slurm name or a comma-separated list of them."""
    if _SLURM_NAME_LIST.fullmatch(value) is None:
        return ('must be a Slurm name or comma-separated names, each from A-Z a-z 0-9 _ . - '
                '(e.g. "gpu" or "gpu,gpu-long")')
    return None


_SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,&|*\[\]()!:-]+")


def slurm_constraint(value: str) -> str | None:
    if _SLURM_CONSTRAINT.fullmatch(value) is None:
        return ('must be a Slurm feature expression from A-Z a-z 0-9 _ . , & | * [ ] ( ) ! : - '
                '(e.g. "h100" or "[rack1|rack2]&ib")')
    return None


# One long option, "--name" or "--name=value"; the value has nothing that sbatch's #SBATCH
# parser treats specially (whitespace splits words, quotes and backslashes are consumed, "#"
# starts a comment).
_SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(?:=[^\s\"'\\#]+)?")


# Options the rendered script sets itself, and the spec key that sets each: a later #SBATCH
# line would silently override it (sbatch takes the last), and sbatch accepts any unambiguous
# prefix of a long option ("--part" is --partition).
_RENDERED_OPTIONS = {
    "job-name": "[job] name", "output": "[job] output_dir", "error": "[job] output_dir",
    "open-mode": "nothing (the script appends)", "signal": "[cluster] signal_grace_s",
    "requeue": "[cluster] requeue", "no-requeue": "[cluster] requeue", "nodes": "nodes",
    "ntasks-per-node": "nothing (one task per node)", "cpus-per-task": "cpus_per_node", "time": "time",
    "gpus-per-node": "gpus_per_node", "mem": "memory", "partition": "partition", "account": "account",
    "qos": "qos", "constraint": "constraint",
}


def _sbatch_option(value: str) -> str | None:
    problem = plain_text(value)
    if problem is not None:
        return problem
    if _SBATCH_OPTION.fullmatch(value) is None:
        return ('must be one long sbatch option, "--name" or "--name=value", with no spaces, quotes, '
                'backslashes or "#" in the value (e.g. "--exclusive", "--gres=gpu:a100:4")')
    name = value[2:].split("=", 1)[0]
    taken = sorted(option for option in _RENDERED_OPTIONS if option.startswith(name))
    if taken:
        keys = ", ".join(dict.fromkeys(_RENDERED_OPTIONS[option] for option in taken))
        return (f"--{name} would override the script's own --{taken[0]}: set it with {keys} instead "
                "(extra_sbatch is for options the spec has no key for, e.g. --exclusive, --gres)")
    return None


sbatch_options = items(_sbatch_option)


def _bind_mount(value: str) -> str | None:
    problem = plain_text(value)
    if problem is not None:
        return problem
    parts = value.split(":")
    if len(parts) > 3 or any(not part.strip() for part in parts):
        return ('must be "src", "src:dst" or "src:dst:opts" with no empty part '
                '(e.g. "/models" or "/scratch/me:/data:ro")')
    return None


bind_mounts = items(_bind_mount)


def container_image(value: str) -> str | None:
    problem = plain_text(value)
    if problem is not None:
        return problem
    if value.startswith("-"):
        return ('must not start with "-": apptainer exec would read it as an option '
                '(write "./-x.sif" for such a file)')
    return None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_assignment(value: str) -> str | None:
    name, equals, assigned = value.partition("=")
    if not equals or _ENV_NAME.fullmatch(name) is None:
        return 'must be "NAME=VALUE" with NAME from A-Z a-z 0-9 _ (not starting with a digit)'
    return plain_text(assigned)


env_assignments = items(_env_assignment)
