"""`relax-hpc validate --image ROOT SPEC`: is everything the spec needs inside that image?

ROOT is an image's root file system, unpacked: `apptainer build --sandbox ROOT relax-hpc.sif`, or
what tools/build-image-root wrote (`/` from inside the image). Nothing in it is run: the check
reads the image's %environment (ROOT/.singularity.d/env/90-environment.sh, where Apptainer keeps
it) and the packages each environment records (``*.dist-info`` in its site-packages), so it also
works for an image whose interpreters cannot start here. What a spec needs (docs/containers.md):

- the interpreter that runs its processes: the Megatron environment's for ``[train] backend =
  "megatron"`` (relax_hpc.launch.container.IMAGE_MEGATRON_PYTHON), else ``python3`` on the
  image's PATH, with relax-hpc, torch and Ray (and megatron-core and megatron-bridge for megatron);
- for ``[rollout] engine = "sglang"`` the SGLang servers' interpreter: ``[rollout.sglang] python``
  when it is an absolute path, else $RELAX_SGLANG_ENV of the image, with sglang installed;
- the decoders of the [media] extra when ``[data]`` names audio or video, and the tracker packages
  that ``[metrics]`` names;
- for components with GPUs, a CUDA build of torch (not ``+cpu``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.launch.container import IMAGE_MEGATRON_PYTHON
from relax_hpc.spec import JobSpec

__all__ = ["ENV_SCRIPT", "ImageEnv", "check_image", "image_variables"]

ENV_SCRIPT = ".singularity.d/env/90-environment.sh"
_EXPORT = re.compile(r"^\s*export\s+([A-Za-z_]\w*)=(.*?)\s*$")


def image_variables(root: Path) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of the image's %environment (quotes removed, $PATH kept as text)."""
    script = root / ENV_SCRIPT
    if not script.is_file():
        return {}
    found: dict[str, str] = {}
    for line in script.read_text(encoding="utf-8", errors="replace").splitlines():
        match = _EXPORT.match(line)
        if match:
            found[match.group(1)] = match.group(2).strip("'\"")
    return found


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class ImageEnv:
    """One Python environment inside the image: its interpreter (a path inside) and packages."""

    python: str
    packages: dict[str, str]  # normalized distribution name -> version

    @classmethod
    def read(cls, root: Path, python: str) -> ImageEnv | None:
        """The environment of `python` (inside the image), None when that interpreter is not there."""
        inside = root / python.lstrip("/")
        if not (inside.is_file() or inside.is_symlink()):
            return None
        packages: dict[str, str] = {}
        env_dir = inside.parent.parent
        for dist_info in env_dir.glob("lib/python3*/site-packages/*.dist-info"):
            name, _, version = dist_info.name.removesuffix(".dist-info").partition("-")
            packages[_normalized(name)] = version
        return cls(python=python, packages=packages)

    def missing(self, names: tuple[str, ...]) -> list[str]:
        return [name for name in names if _normalized(name) not in self.packages]


def _main_python(root: Path, variables: dict[str, str]) -> str | None:
    """The first ``python3`` on the image's PATH (its %environment first, then the usual system dirs)."""
    path = variables.get("PATH", "").replace("$PATH", "").replace("${PATH}", "")
    for directory in [*path.split(":"), "/usr/local/bin", "/usr/bin", "/bin"]:
        if directory.startswith("/") and (root / directory.lstrip("/") / "python3").exists():
            return f"{directory.rstrip('/')}/python3"
    return None


def _runner_needs(spec: JobSpec) -> tuple[str, ...]:
    needs = ["relax-hpc", "torch", "ray"]
    if spec.train.backend == "megatron":
        needs += ["megatron-core", "megatron-bridge"]
    if spec.data.audio_key or spec.data.video_key:
        needs += ["av", "soundfile", "soxr"]
    m = spec.metrics
    needs += [name for name, wanted in (("wandb", m.wandb_project), ("clearml", m.clearml_project),
                                        ("mlflow-skinny", m.mlflow_experiment)) if wanted]
    return tuple(needs)


def _uses_gpus(spec: JobSpec) -> bool:
    return spec.train.device == "cuda" or any(
        c.gpus_per_node > 0 for c in (spec.cluster.trainer, spec.cluster.rollout, spec.cluster.forward) if c is not None)


def check_image(spec: JobSpec, root: Path, source: str) -> list[str]:
    """One line per environment the spec uses; ValueError listing every problem otherwise."""
    if not root.is_dir():
        hint = " (a .sif file: unpack it with `apptainer build --sandbox DIR IMAGE`)" if root.is_file() else ""
        raise ValueError(f"--image {root}: not a directory{hint}; pass the image's root file system")
    variables = image_variables(root)
    problems: list[str] = []
    lines: list[str] = []
    if not variables:
        problems.append(f"{root / ENV_SCRIPT} is missing or sets nothing: is {root} an image built from "
                        "container/relax.def (apptainer build --sandbox, or tools/build-image-root)?")
    if spec.train.backend == "megatron":
        runner, why = IMAGE_MEGATRON_PYTHON, 'train.backend = "megatron"'
    else:
        runner, why = _main_python(root, variables) or "python3", "python3 on the image's PATH"
    env = ImageEnv.read(root, runner)
    if env is None:
        problems.append(f"{why}: {runner} is not in the image {root}")
    else:
        missing = env.missing(_runner_needs(spec))
        if missing:
            problems.append(f"{why}: {runner} lacks {', '.join(missing)} (install them into that environment "
                            "from its lock file, container/locks/)")
        torch = env.packages.get("torch", "")
        if torch.endswith("+cpu") and _uses_gpus(spec):
            problems.append(f"{runner} has torch {torch}, the CPU build, and the spec asks for GPUs: build the "
                            "CUDA variant of the image (apptainer build relax-hpc.sif container/relax.def)")
        lines.append(f"image {root}: {runner} runs the job (relax-hpc {env.packages.get('relax-hpc', '?')}, "
                     f"torch {torch or '?'})")
    if spec.rollout.on_sglang:
        problems += _sglang_problems(spec, root, variables, lines)
    if problems:
        raise ValueError(f"{source}: the image {root} lacks what the spec needs:\n  " + "\n  ".join(problems))
    return lines


def _sglang_problems(spec: JobSpec, root: Path, variables: dict[str, str], lines: list[str]) -> list[str]:
    named = spec.rollout.sglang.python
    if named is not None and not named.startswith("/"):
        lines.append(f"[rollout.sglang] python = {named!r} is relative to the job's working directory (bound "
                     "from the host), not checked inside the image")
        return []
    if named is None:
        side = variables.get("RELAX_SGLANG_ENV")
        if side is None:
            return ['rollout.engine = "sglang" and [rollout.sglang] python is unset, but the image sets no '
                    "RELAX_SGLANG_ENV: set python to the SGLang interpreter inside the image"]
        named = f"{side.rstrip('/')}/bin/python"
    env = ImageEnv.read(root, named)
    if env is None:
        return [f'rollout.engine = "sglang": {named} is not in the image {root}']
    if env.missing(("sglang",)):
        return [f'rollout.engine = "sglang": {named} has no sglang installed']
    lines.append(f"image {root}: {named} serves SGLang {env.packages['sglang']}")
    return []
