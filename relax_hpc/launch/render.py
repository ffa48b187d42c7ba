"""Compile a validated job spec into the text of one heterogeneous sbatch script (pure).

    from relax_hpc.launch.render import render_sbatch
    text = render_sbatch(spec, job_dir="/shared/runs/x", spec_file="/shared/runs/x/spec.submit.toml")

The text comes from the readable template ``relax_hpc/launch/templates/hetjob.sbatch.in``
(package data, so an installed wheel has it; sbatch/ in the checkout links to it, and
``$RELAX_HPC_SBATCH_DIR`` names another folder to read it from). Its ``{{name}}``
placeholders are filled in here and nothing else is generated, so someone who knows sbatch
but not Python can read (and change) what every job runs. Same spec, same text: the golden
files in tests/launch/golden/ pin it.

Nothing from the spec becomes shell. The spec checks (relax_hpc/spec/text_checks.py) already
refuse every string that could break out of its place; as a second line of defence every
value is checked again here: a control character anywhere (a newline would end an #SBATCH
comment and start a shell line) is a ValueError, a word of an #SBATCH line is quoted the way
sbatch's parser reads quotes when it holds a space, quote, backslash or "#" (so it stays one
word), and shell words are shlex-quoted (container.py quotes its own). The job directory in
the ``--output`` filename pattern has its "%" doubled; one with a backslash is refused there.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from relax_hpc.launch.container import IMAGE_MEGATRON_PYTHON, render_wrapper
from relax_hpc.spec import ComponentSpec, JobSpec
from relax_hpc.spec.text_checks import control_character

__all__ = ["Component", "components", "output_pattern", "read_template", "render_sbatch", "sbatch_headers"]

_PLACEHOLDER = re.compile(r"\{\{([a-z_]+)\}\}")
TEMPLATE = "hetjob.sbatch.in"
# What sbatch's #SBATCH parser treats specially (src/sbatch/opt.c, get_argument): whitespace
# ends a word, quotes group, a backslash escapes the next character, "#" starts a comment.
_SBATCH_SPECIAL = re.compile(r"[\s\"'\\#]")


def read_template() -> tuple[str, str]:
    """(text, where it came from) of the hetjob template: $RELAX_HPC_SBATCH_DIR, else the package's."""
    override = os.environ.get("RELAX_HPC_SBATCH_DIR")
    if override:
        path = Path(override) / TEMPLATE
        return path.read_text(encoding="utf-8"), str(path)
    packaged = resources.files("relax_hpc.launch") / "templates" / TEMPLATE
    return packaged.read_text(encoding="utf-8"), str(packaged)


@dataclass(frozen=True)
class Component:
    """One hetjob group: its index, name, spec and the Ray slot of its first node.

    ``also_hosts``: other components' Ray resources its nodes advertise too, because their roles
    run here (``[cluster] colocate``: the trainer's nodes host the rollout engines).
    """

    group: int
    name: str
    spec: ComponentSpec
    first_slot: int
    also_hosts: tuple[str, ...] = ()


def components(spec: JobSpec) -> list[Component]:
    """The hetjob groups in order: trainer (0), rollout, forward when present.

    With ``[cluster] colocate = true`` there is no rollout group (the engines share the
    trainer's nodes), so forward, when present, is group 1.
    """
    colocate = spec.cluster.colocate
    named = [("trainer", spec.cluster.trainer, ("rollout",) if colocate else ())]
    if not colocate:
        named.append(("rollout", spec.cluster.rollout, ()))
    if spec.cluster.forward is not None:
        named.append(("forward", spec.cluster.forward, ()))
    out, slot = [], 0
    for group, (name, component, also_hosts) in enumerate(named):
        out.append(Component(group, name, component, slot, also_hosts))
        slot += component.nodes
    return out


def critic_component(spec: JobSpec) -> str | None:
    """Where PPO's critic runs ([critic], roles/critic_roles.py): the forward group when the job
    has one, else the trainer's nodes; None without a critic."""
    if spec.critic is None:
        return None
    return "forward" if spec.cluster.forward is not None else "trainer"


def _plain(text: str, what: str) -> str:
    """``text`` unchanged; ValueError when it holds a control character.

    Spec values never do (the spec checks refuse them); the job directory may also come from
    the command line or the working directory.
    """
    found = control_character(text)
    if found is not None:
        raise ValueError(f"{what} = {text!r}: contains a control character ({found}), which would break "
                         "the batch script; remove it")
    return text


def _sbatch_word(word: str, what: str) -> str:
    """One word of an #SBATCH line, quoted for sbatch's parser when it has to be."""
    if _SBATCH_SPECIAL.search(_plain(word, what)) is None:
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _count(value: int, what: str) -> str:
    # Numbers come from int fields; anything else reaching here is a bug, not text to write.
    if type(value) is not int:
        raise ValueError(f"{what} = {value!r}: expected an integer")
    return str(value)


def _option(name: str, value: object) -> str:
    return "#SBATCH " + _sbatch_word(f"--{name}={value}", f"#SBATCH --{name}")


def output_pattern(job_dir: str) -> str:
    """The ``--output`` filename pattern JOBDIR/logs/slurm-%j.out, with JOBDIR taken literally.

    Slurm replaces "%j", "%u", ... in the pattern and reads "%%" as one "%"; a backslash
    anywhere turns all replacement off and is itself dropped (Slurm's expand_stdio_fields), so
    a directory with a backslash cannot be named there at all.
    """
    if "\\" in job_dir:
        raise ValueError(f"the job directory = {job_dir!r}: contains a backslash, which Slurm's --output "
                         "filename pattern cannot hold (Slurm drops it and leaves %j unexpanded, so the "
                         "log would go elsewhere); choose a directory without backslashes ([job] output_dir, "
                         "or --job-dir of relax-hpc render)")
    return job_dir.replace("%", "%%") + "/logs/slurm-%j.out"


def sbatch_headers(spec: JobSpec, job_dir: str) -> list[str]:
    """Every ``#SBATCH`` line: job-wide options first, then one block per hetjob group."""
    lines = [
        _option("job-name", spec.job.name),
        # Only the first lines of an attempt land here; the script logs to logs/restart-N/.
        _option("output", output_pattern(job_dir)),
        _option("open-mode", "append"),
        _option("signal", f"B:USR1@{_count(spec.cluster.signal_grace_s, 'cluster.signal_grace_s')}"),
        "#SBATCH --requeue" if spec.cluster.requeue else "#SBATCH --no-requeue",
    ]
    groups = components(spec)
    for component in groups:
        c = component.spec
        if component.group > 0:
            lines.append("#SBATCH hetjob")
        hosts = ", and the critic" if component.name == critic_component(spec) else ""
        lines.append(f"# group {component.group}: {component.name}, {_count(c.nodes, 'nodes')} node(s){hosts}")
        lines += [_option("nodes", c.nodes), _option("ntasks-per-node", 1),
                  _option("cpus-per-task", c.cpus_per_node), _option("time", c.time)]
        if c.gpus_per_node > 0:
            lines.append(_option("gpus-per-node", c.gpus_per_node))
        optional = [("mem", c.memory), ("partition", c.partition), ("account", c.account),
                    ("qos", c.qos), ("constraint", c.constraint)]
        lines += [_option(name, value) for name, value in optional if value is not None]
        extra_key = f"cluster.{component.name}.extra_sbatch"
        lines += ["#SBATCH " + _sbatch_word(extra, extra_key) for extra in c.extra_sbatch]
    return lines


def _start_ray_lines(spec: JobSpec) -> list[str]:
    lines = []
    for component in components(spec):
        c = component.spec
        resource = c.gpus_per_node if c.gpus_per_node > 0 else 1
        counts = (c.cpus_per_node, c.gpus_per_node, resource)
        common = " ".join(_count(n, f"cluster.{component.name}") for n in counts)
        name, group, slot = component.name, component.group, component.first_slot
        # start_ray passes its last argument on unquoted, so extra flags of `incluster node` ride along.
        also = "".join(f" --also-resource={other}" for other in component.also_hosts)
        if group == 0:
            head = f'"--head{also}"' if also else "--head"
            lines.append(f'start_ray ray-head 0 trainer 1 0 {common} --nodelist="$HEAD_NODE" {head}')
            if c.nodes > 1:
                lines.append(f'start_ray ray-trainer 0 trainer {c.nodes - 1} 1 {common} '
                             f'--exclude="$HEAD_NODE" "--address=$HEAD{also}"')
        else:
            lines.append(f'start_ray ray-{name} {group} {name} {c.nodes} {slot} {common} - "--address=$HEAD{also}"')
    return lines


def _fill(template: str, values: dict[str, str], source: str) -> str:
    missing = sorted(set(_PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise ValueError(f"{source}: no value for placeholder(s) {missing}; known: {sorted(values)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def image_python(spec: JobSpec) -> str:
    """The interpreter inside the image: the Megatron environment's for backend = "megatron" (its
    transformers cannot share the main environment, container/relax.def), else python3 on PATH."""
    return IMAGE_MEGATRON_PYTHON if spec.train.backend == "megatron" else "python3"


def render_sbatch(spec: JobSpec, job_dir: str, spec_file: str) -> str:
    """The sbatch script of ``spec``; ``job_dir`` and ``spec_file`` as the job will see them."""
    groups = components(spec)
    python = image_python(spec) if spec.container.image is not None else '"${RELAX_HPC_PYTHON:-python3}"'
    values = {
        "job_name": _plain(spec.job.name, "job.name"),  # in a comment line
        "sbatch_headers": "\n".join(sbatch_headers(spec, job_dir)),
        "job_dir": shlex.quote(_plain(job_dir, "the job directory")),
        "spec_file": shlex.quote(_plain(spec_file, "the spec file")),
        "total_nodes": _count(sum(g.spec.nodes for g in groups), "the total of cluster.*.nodes"),
        "ray_join_timeout_s": _count(spec.cluster.ray_join_timeout_s, "cluster.ray_join_timeout_s"),
        "requeue": "1" if spec.cluster.requeue else "0",
        "max_global_restarts": _count(spec.health.max_global_restarts, "health.max_global_restarts"),
        "python": python,
        "wrappers": "\n".join(render_wrapper(g.name, spec.container, g.spec.gpus_per_node) for g in groups),
        "start_ray_lines": "\n".join(_start_ray_lines(spec)),
    }
    template, source = read_template()
    return _fill(template, values, source)
